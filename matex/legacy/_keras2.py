"""Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``) under Horovod's Keras API.

Horovod's ``DistributedOptimizer`` for a Keras 2 optimizer (tf-keras's
``tf.keras.optimizers.*`` and ``tf.keras.optimizers.legacy.*``, i.e.
``OptimizerV2``), with Horovod's Keras 2 semantics: the returned optimizer is
a new instance, made with ``from_config`` of a subclass of the wrapped
optimizer's class (same class name, so a saved model loads without MaTEx);
its gradients are averaged over ranks where Keras 2 computes them
(``compute_gradients``/``_compute_gradients``, which ``minimize`` and so
``fit`` call, and ``get_gradients``), not in ``apply_gradients``: a custom
loop that computes gradients itself uses ``hvd.DistributedGradientTape``, as
with Horovod. ``variables`` is a list that can also be called
(``opt.variables()``). ``backward_passes_per_step=N`` accumulates locally,
reduces on the N-th call and applies then; the other calls only advance
``iterations`` (the accumulator is ``opt._agg_helper``, as in Horovod).

Also here: the protocol tf-keras's ``CallbackList`` expects of a callback
(MaTEx's Horovod callbacks are Keras 3 callbacks that then work in both), and
the transparent path's refusal of tf-keras training on several ranks.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

from matex import _compat, _recovery, _state

LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"


def legacy_keras_active() -> bool:
    """Whether ``tf.keras`` is tf-keras (TensorFlow's own test of ``TF_USE_LEGACY_KERAS``)."""
    return os.environ.get(LEGACY_KERAS_VAR, "").strip().lower() in ("1", "true")


def is_keras2(obj: Any) -> bool:
    """Whether ``obj`` is a tf-keras object (an optimizer, model or layer of Keras 2)."""
    return any(getattr(c, "__module__", "").startswith("tf_keras.") for c in type(obj).__mro__)


class _CallableList(list):
    """A list that is also its own ``()``: ``opt.variables`` and ``opt.variables()``."""

    def __call__(self) -> list:
        return self


def _cond(pred, true_fn, false_fn):
    if tf.executing_eagerly():
        return true_fn() if bool(pred) else false_fn()
    return tf.cond(pred, true_fn, false_fn)


class _DistributedKeras2:
    """Mixed in first: gradients reduced as Horovod's Keras 2 ``DistributedOptimizer`` does.

    The options live on the made class (``_matex_hvd``), so ``from_config`` on
    it, or on an instance, makes another distributed optimizer.
    """

    _matex_hvd: dict = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._matex_start()

    def _matex_start(self) -> None:
        from matex.horovod import _training

        s = type(self)._matex_hvd
        reduction = _training.HorovodReduction(s["op"], s["compressor"], s["sparse_as_dense"],
                                     s["passes"], s["average_aggregated"], s["local_layers"],
                                     s["scale_local"])
        reduction = _training.reduce_within(reduction, s["process_set"])
        # plain attributes: Keras 2's tracking must not take them for optimizer state
        object.__setattr__(self, "_matex_reduction", reduction)
        object.__setattr__(self, "_agg_helper", reduction if s["passes"] > 1 else None)
        object.__setattr__(self, "process_set", s["process_set"])
        if s["passes"] > 1:   # the counter and accumulators: recovery state, as Keras 3's
            _recovery.join(self, "accumulation",
                           lambda optimizer, variables: reduction.recovery_state(optimizer))

    @property
    def variables(self) -> _CallableList:
        found = super().variables
        return _CallableList(found() if callable(found) else found)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; divided by the number of ranks
        with ``scale_local_gradients``)."""
        self._matex_reduction.register_local_var(var)

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list:
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list:
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):      # OptimizerV2 (legacy)
            pairs = list(base._compute_gradients(loss, var_list, grad_loss, tape=tape))
        else:                                         # tf-keras's Optimizer
            pairs = list(base.compute_gradients(loss, var_list, tape=tape))
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        return list(zip(self._matex_allreduce(grads, variables), variables))

    def get_gradients(self, loss: Any, params: list) -> list:
        grads = super().get_gradients(loss, params)
        return self._matex_allreduce(grads, params)

    def _matex_allreduce(self, grads: list, variables: list) -> list:
        """Reduced gradients; with accumulation the reduced sums on the N-th call, the local
        sums on the others (not applied: ``apply_gradients`` only counts then)."""
        from matex import _faults

        if _faults.pending():   # MATEX_INJECT_FAULT's kills, as Keras 3's (else no op added)
            with tf.control_dependencies([_faults.graph_hook(self.iterations)]):
                grads = [tf.identity(g) if isinstance(g, tf.Tensor) else g for g in grads]
        reduction = self._matex_reduction
        if reduction.passes == 1:
            return reduction.reduce(grads, variables)
        summed = reduction.accumulate(grads, variables)
        present = [i for i, g in enumerate(summed) if g is not None]

        def reduced():
            out = reduction.finish(summed, variables)
            return [tf.convert_to_tensor(out[i]) for i in present]

        def local():
            return [tf.identity(summed[i]) for i in present]

        values = _cond(reduction.due(), reduced, local)
        out = list(summed)
        for i, value in zip(present, values):
            out[i] = value
        return out

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        reduction = self._matex_reduction
        base = super()
        if reduction.passes == 1:
            return base.apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        iterations = self.iterations   # made here (OptimizerV2 makes it on first use)

        def apply():
            base.apply_gradients(pairs, *args, **kwargs)
            reduction.clear()
            return tf.constant(True)

        def count():
            iterations.assign_add(1)
            return tf.constant(False)

        if reduction.counter is None:   # nothing accumulated: Horovod applies nothing either
            return count()
        return _cond(reduction.due(), apply, count)


def _distributed_class(cls: type, settings: dict) -> type:
    """The distributed subclass of optimizer class ``cls`` for these options."""
    return type(cls.__name__, (_DistributedKeras2, cls),
                {"_matex_hvd": settings, "__doc__": cls.__doc__})


def distributed_optimizer(optimizer: Any, op: str, compressor: Any, sparse_as_dense: bool,
                          backward_passes_per_step: int, average_aggregated_gradients: bool,
                          process_set: Any, scale_local_gradients: bool,
                          local_layers: Any) -> Any:
    """Horovod's Keras 2 ``DistributedOptimizer``: a new distributed copy of ``optimizer``."""
    settings = {"op": op, "compressor": compressor, "sparse_as_dense": sparse_as_dense,
                "passes": backward_passes_per_step,
                "average_aggregated": average_aggregated_gradients,
                "local_layers": list(local_layers or ()), "scale_local": scale_local_gradients,
                "process_set": process_set}
    cls = _distributed_class(type(optimizer), settings)
    return cls.from_config(optimizer.get_config())


def horovod_optimizer(optimizer: Any, compression: Any, sparse_as_dense: bool,
                      backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                      average_aggregated_gradients: bool, num_groups: int, groups: Any,
                      process_set: Any, scale_local_gradients: bool, local_layers: Any,
                      what: str) -> Any:
    """``hvd.DistributedOptimizer``'s arguments (Horovod's integers and classes) checked as
    for Keras 3, then ``distributed_optimizer``."""
    from matex.compression import _spec
    from matex.horovod import _training

    _training.check_training_args(what, backward_passes_per_step, gradient_predivide_factor,
                                  op, num_groups, groups, process_set)
    return distributed_optimizer(
        optimizer, _training.training_op(op, what),
        _spec.from_spec(_training.compression_spec(compression)), sparse_as_dense,
        backward_passes_per_step, average_aggregated_gradients, process_set,
        scale_local_gradients, local_layers)


def make_distributed_in_place(optimizer: Any, op: str, compressor: Any) -> Any:
    """``optimizer`` (a loaded one, with its state) turned distributed in place."""
    if isinstance(optimizer, _DistributedKeras2):
        return optimizer
    settings = {"op": op, "compressor": compressor, "sparse_as_dense": False, "passes": 1,
                "average_aggregated": False, "local_layers": [], "scale_local": True,
                "process_set": None}
    optimizer.__class__ = _distributed_class(type(optimizer), settings)
    optimizer._matex_start()
    return optimizer


def load_model(filepath: str, custom_optimizers: list | None, custom_objects: dict | None,
               op: str, compressor: Any) -> Any:
    """tf-keras's ``load_model`` whose optimizer comes back distributed, its state kept."""
    import tf_keras

    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = tf_keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None and is_keras2(model.optimizer):
        make_distributed_in_place(model.optimizer, op, compressor)
    return model


def optimizer_variables(optimizer: Any) -> list:
    """A Keras 2 optimizer's variables as they exist now (none before its first step)."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def has_momentum_hyperparameter(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Keras 2 legacy optimizer with a ``momentum`` hyperparameter
    (a variable its step reads, so setting it between batches takes effect)."""
    return is_keras2(optimizer) and _compat.tf_keras_has_hyperparameter(optimizer, "momentum")


def build_optimizer(optimizer: Any, var_list: list) -> None:
    """Make a Keras 2 optimizer's slots for ``var_list`` now (idempotent)."""
    _compat.tf_keras_build_optimizer(optimizer, var_list)


# ---- callbacks: tf-keras's CallbackList protocol on MaTEx's (Keras 3) callbacks ----------

_TRAIN = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
_TEST = ("on_test_batch_begin", "on_test_batch_end")
_PREDICT = ("on_predict_batch_begin", "on_predict_batch_end")


def _overrides(callback: Any, names: tuple) -> bool:
    import keras

    base = keras.callbacks.Callback
    return any(getattr(type(callback), n, None) is not getattr(base, n, None) for n in names)


class Keras2Callback:
    """What tf-keras's ``fit`` asks of a callback beyond Keras 3's ``Callback``.

    Mixed into MaTEx's Horovod callbacks, so one class serves Keras 3 and
    tf-keras models. Batch hooks are called only where the class defines them.
    """

    _supports_tf_logs = False

    def _implements_train_batch_hooks(self) -> bool:
        return _overrides(self, _TRAIN)

    def _implements_test_batch_hooks(self) -> bool:
        return _overrides(self, _TEST)

    def _implements_predict_batch_hooks(self) -> bool:
        return _overrides(self, _PREDICT)


# ---- the transparent path: tf-keras training on several ranks is refused --------------

TRANSPARENT_MESSAGE = (
    "matex: this script trains with Keras 2 (tf-keras: TF_USE_LEGACY_KERAS=1 or "
    "`import tf_keras`), which the transparent path (python -m matex / matexrun without "
    "--horovod, import matex.keras) does not distribute: on %d ranks it would train %d "
    "separate models. Either run it with Keras 3 (unset TF_USE_LEGACY_KERAS; `import keras`), "
    "or use Horovod's Keras API under `matexrun --horovod` (hvd.DistributedOptimizer, "
    "hvd.callbacks.BroadcastGlobalVariablesCallback(0), each rank reading its shard).")

_now = _state.namespace("legacy.keras2", refusing=False)   # tf-keras's training refused


def refuse_transparent(module: Any = None) -> None:
    """On several ranks, make tf-keras's training entry points raise one clear error.

    ``Model.fit``, ``Model.train_on_batch`` and the optimizers'
    ``apply_gradients`` (custom loops) raise ``RuntimeError`` on every rank
    (each rank runs the same script, so each reaches the same call); a single
    process is left alone. Evaluation and prediction are unaffected (each
    rank computes the same thing).
    """
    from matex import _runtime

    if _now.refusing:
        return
    _runtime.init()
    size = _runtime.size()
    if size < 2:
        return
    _now.refusing = True
    message = TRANSPARENT_MESSAGE % (size, size)

    def refuse(original):
        def refused(*args, **kwargs):
            raise RuntimeError(message)

        refused.__wrapped__ = original
        refused.__doc__ = original.__doc__
        return refused

    for cls, name in _compat.tf_keras_training_entry_points():
        setattr(cls, name, refuse(getattr(cls, name)))
