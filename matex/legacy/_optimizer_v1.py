"""A ``tf.compat.v1.train.Optimizer`` whose gradients are reduced over ranks (TF1 graphs).

Horovod's TF1 ``DistributedOptimizer`` (``matex.horovod.tensorflow``) and the
unmodified-script path (``python -m matex``) both build on ``reduce_pairs``:
the ``(gradient, variable)`` pairs of one ``compute_gradients`` call, their
gradients reduced with MaTEx's fused (grouped) allreduce, ``None`` kept.

``DistributedOptimizerV1`` follows Horovod's ``_DistributedOptimizer``:
``compute_gradients`` asks the wrapped optimizer, then reduces;
``apply_gradients``, ``get_slot``, ``get_slot_names`` and ``variables`` are
the wrapped optimizer's, so ``minimize(loss, global_step=, var_list=)`` (the
base class's: compute, then apply) behaves as on the wrapped optimizer with
averaged gradients.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import tensorflow as tf

Reduce = Callable[[list, list], list]   # (gradients, variables) -> reduced gradients

# set while a DistributedOptimizerV1 computes its gradients: the unmodified-script path
# (matex.legacy._script) must not reduce the wrapped optimizer's a second time
reducing = contextvars.ContextVar("matex_v1_reducing", default=False)

# the ops producing reduced gradients, by graph: the unmodified-script path tells a
# training run (one that reaches them) from any other run
_REDUCED_COLLECTION = "matex_reduced_gradients"


def mark_reduced(tensors: list) -> None:
    """Record ``tensors`` (reduced gradients) in their graph's collection."""
    for t in tensors:
        if t is None:
            continue
        op = t.values.op if isinstance(t, tf.IndexedSlices) else t.op
        op.graph.add_to_collection(_REDUCED_COLLECTION, op)


def reduced_ops(graph: tf.Graph) -> list:
    """The ops of ``graph`` that produce reduced gradients."""
    return graph.get_collection(_REDUCED_COLLECTION)


def reduce_pairs(grads_and_vars: list, reduce: Reduce) -> list:
    """``grads_and_vars`` with every non-None gradient replaced by ``reduce``'s result."""
    pairs = list(grads_and_vars)
    at = [i for i, (g, _) in enumerate(pairs) if g is not None]
    if not at:
        return pairs
    reduced = reduce([pairs[i][0] for i in at], [pairs[i][1] for i in at])
    mark_reduced(reduced)
    for i, g in zip(at, reduced):
        pairs[i] = (g, pairs[i][1])
    return pairs


class DistributedOptimizerV1(tf.compat.v1.train.Optimizer):
    """``optimizer`` (a ``tf.compat.v1.train.Optimizer``) with gradients reduced over ranks.

    ``reduce(grads, variables)`` does the reduction (Horovod's options decide
    it: op, compression, sparse_as_dense, process set). Graph mode only, as
    Horovod's TF1 optimizer; eagerly the reduction runs eagerly too.
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, reduce: Reduce,
                 name: str | None = None, use_locking: bool = False) -> None:
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise TypeError("DistributedOptimizerV1 wraps a tf.compat.v1.train.Optimizer, "
                            "not %r" % (optimizer,))
        super().__init__(name=name or "Distributed%s" % type(optimizer).__name__,
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reduce = reduce

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced."""
        token = reducing.set(True)
        try:
            pairs = self._optimizer.compute_gradients(*args, **kwargs)
        finally:
            reducing.reset(token)
        return reduce_pairs(pairs, self._reduce)

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``apply_gradients``."""
        token = reducing.set(True)
        try:
            return self._optimizer.apply_gradients(*args, **kwargs)
        finally:
            reducing.reset(token)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list:
        return self._optimizer.variables(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # anything else (a learning rate attribute, _lr...) is the wrapped optimizer's
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)


def horovod_optimizer(optimizer: tf.compat.v1.train.Optimizer, reduction: Any,
                      what: str = "DistributedOptimizer") -> DistributedOptimizerV1:
    """Horovod's TF1 ``DistributedOptimizer``: ``reduction`` (a
    ``matex.horovod._training.HorovodReduction``) reduces each ``compute_gradients``.

    The optimizer gains Horovod's ``register_local_var(var)``.
    """
    if reduction.passes != 1:
        raise NotImplementedError(
            "%s: backward_passes_per_step > 1 is not supported with a TF1 "
            "tf.compat.v1.train optimizer on matex (accumulate in the script, or use a Keras "
            "optimizer)" % what)
    wrapped = DistributedOptimizerV1(optimizer, reduction.reduce)
    wrapped.register_local_var = reduction.register_local_var
    return wrapped


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Horovod's hook: rank ``root_rank``'s global variables on every rank once the
    session exists (after its initialiser or checkpoint restore).

    ``begin`` builds the broadcast (before ``MonitoredTrainingSession`` finalises
    the graph), ``after_create_session`` runs it, alone.
    """

    def __init__(self, root_rank: int, device: str = "", process_set: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device
        self.process_set = process_set

    def begin(self) -> None:
        from matex.horovod import _api

        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = _api.broadcast_variables(
                    tf.compat.v1.global_variables(), self.root_rank,
                    process_set=self.process_set)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
