"""Optimizers become distributed: at ``compile``, or on their first ``apply`` in a custom loop."""

import functools

from matex import _optimizer, _runtime
from matex._keras import batchnorm, strategies
from matex._keras.calls import bind


def compile_wrapper(original):
    """``compile`` wraps the optimizer in ``DistributedOptimizer``."""
    @functools.wraps(original)
    def compile_(self, *args, **kwargs):
        given = bind(original, self, *args, **kwargs).arguments.get("optimizer")
        # An optimizer the script wrapped itself means the script shards its
        # own data (explicit use): fit/evaluate/predict then leave data alone.
        # (LocalSGD and DiLoCo say how ranks synchronise, not who shards: fit still slices)
        strategy = getattr(getattr(given, "_matex", None), "strategy", None)
        self._matex_explicit = (_optimizer.is_distributed(given)
                                and not getattr(strategy, "leaves_data_to_fit", False))
        # a tf.distribute strategy's scope: one replica per rank, or one error on every rank
        strategies.check_on_every_rank(strategies.model_strategy(self), "compile")
        result = original(self, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None:
            self.optimizer = _optimizer.DistributedOptimizer(self.optimizer)
        return result

    return compile_


def apply_wrapper(original):
    """Any optimizer's first ``apply`` makes it distributed (custom loops, unmodified)."""
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if _optimizer.is_distributed(self) or _optimizer.is_reduced_by_wrapper(self):
            return original(self, grads, trainable_variables)
        # a custom loop inside strategy.run: the strategy the optimizer was made under
        strategies.check_on_every_rank(strategies.optimizer_strategy(self), "optimizer.apply")
        _optimizer.DistributedOptimizer(self)
        return self.apply(grads, trainable_variables)

    return apply


def train_step_wrapper(original):
    """``fit``'s step weights gradients by this rank's rows (see ``matex._batch_slicing``)."""
    @functools.wraps(original)
    def step(self, data):
        if not getattr(self, "_matex_weighted", False) or _runtime.size() == 1:
            return original(self, data)   # (one rank: its rows are all the rows)
        with _optimizer.rows_of_step(self.optimizer, data) as step:
            with batchnorm.weighted_by(step.rows):   # synchronised BN's gradient weights
                return original(self, data)

    return step
