"""DistributedOptimizer: any Keras 3 optimizer, averaging gradients over ranks.

Keras 3 optimizers funnel every update (``model.fit``, ``apply_gradients``,
``apply``) through ``BaseOptimizer.apply``; the wrapper overrides exactly that:
it reduces the gradients over ranks (fused, see ``_fusion``) and then lets the
wrapped class apply them. Every rank applies identical averaged gradients to
identical weights, so weights stay bitwise equal.

The first step starts from rank 0's weights: on the first ``apply`` the
trainable variables and the optimizer's own variables are broadcast from
rank 0 (see ``_matex_first_step_sync``).

XLA: a custom op has no XLA kernel. When a model compiled with
``jit_compile=True`` trains with this optimizer, ``fit``'s step is split:
forward, backward and metrics stay XLA-compiled; the gradients leave the XLA
cluster, are reduced, and are applied outside it (``_split_xla_step``).
"""

from __future__ import annotations

import threading

from typing import TYPE_CHECKING, Optional

import tensorflow as tf

from matex import _collectives, _commit, _compat, _config, _faults, _recovery, _state
from matex._recovery import has_value
from matex.compression import _spec as _compression
from matex.compression import _reduce

if TYPE_CHECKING:
    import keras

    from matex.compression import Compressor

# optimizer class -> its distributed subclass, made once
_classes = _state.table("optimizer.classes", lifetime="process")
_classes_lock = threading.Lock()


class _State:
    """Per-optimizer MaTEx settings; a plain object so TF checkpoints ignore it."""

    def __init__(self, op, threshold):
        self.op = op
        self.threshold = threshold
        self.synced = False          # first-step broadcast done
        self.rows = None             # this rank's rows in the step being traced, or None
        self.flags = []              # in-graph first-step sync flags
        self.capture = None          # list collecting gradients (XLA split), or None
        self.strategy = None         # fewer synchronisations: _delayed.Delayed, localsgd
        self.compression = None      # a matex.compression compressor, or None
        self.joined = {}             # key -> maker of a per-step state (_recovery.join)
        self.skipped = None          # tf.Variable: steps in a row the commit vote refused


class _DistributedMixin:
    """Methods mixed in front of the wrapped optimizer's class."""

    def apply(self, grads, trainable_variables=None):
        if is_reduced_by_wrapper(self):   # the wrapping optimizer reduced them already
            return super().apply(grads, trainable_variables)
        state = self._matex
        grads = list(grads)
        if state.capture is not None:
            state.capture.append((grads, list(trainable_variables or [])))
            return None
        if _faults.pending() and not tf.executing_eagerly():   # tracing the step
            with tf.init_scope():
                _faults.maybe_fail(int(self.iterations.numpy()), "build")
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                self.build(trainable_variables)
                self.built = True
        alone = state.strategy is None and _reduce.nothing_to_reduce(state.compression)
        gate = None
        if not state.synced:
            if alone:   # one rank: its weights are rank 0's
                state.synced = True
            else:
                gate = self._matex_first_step_sync(
                    trainable_variables or _compat.optimizer_trainable_variables(self))
        gates = [gate] if gate is not None else []
        hook = _faults.graph_hook(self.iterations)
        if hook is not None:
            gates.append(hook)
        with tf.control_dependencies(gates):
            if alone:   # nothing to reduce, no commit to order: plain Keras's update
                return super().apply(grads, trainable_variables)
            if state.strategy is not None:   # delay=1 (_delayed), LocalSGD/DiLoCo (localsgd)
                return state.strategy.apply(self, grads, trainable_variables, super().apply,
                                            state.op, state.rows)
            names = _variable_names(trainable_variables, len(grads))
            vote = None
            if state.rows is not None and state.op == "average":
                grads, vote = _weighted_average(grads, state.rows, state.threshold, names,
                                                trainable_variables, state.compression,
                                                vote=_votes(self))
            else:
                if state.op == "adasum":   # dense: Adasum combines whole vectors
                    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                             for g in grads]
                grads = _reduce.reduce_gradients(grads, trainable_variables, state.compression,
                                                 state.op, state.threshold, names)
        # all-or-nothing: after every reduced gradient, before any later collective
        inner_apply = super().apply
        if vote is None:
            return _commit.commit(lambda: inner_apply(grads, trainable_variables), after=grads)
        against, mine = vote
        skipped = self._matex_skipped()
        return _commit.commit(
            lambda: _commit.if_voted(against, mine,
                                     lambda: inner_apply(grads, trainable_variables),
                                     skipped, self.iterations), after=grads)

    def _matex_skipped(self):
        """The count of steps in a row the commit vote refused (made once, untracked)."""
        state = self._matex
        if state.skipped is None:
            with tf.init_scope():
                state.skipped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="matex_skipped_steps")
        return state.skipped

    def _matex_first_step_sync(self, variables):
        """Broadcast rank 0's weights and optimizer state; returns a tensor or None.

        Variables that already hold a value are broadcast eagerly, even while a
        tf.function is traced (init_scope), so before the first step runs.
        Variables created inside the trace have no value until the function
        first runs: those are broadcast in-graph, once, under a tf.cond that is
        explicitly ordered after the collectives already in the graph; the
        returned tensor must gate the collectives that follow.
        """
        state = self._matex
        everything = list(variables) + list(self.variables)
        with tf.init_scope():
            ready = [v for v in everything if has_value(v)]
            _collectives.broadcast_variables(ready, 0)
        state.synced = True
        pending = [v for v in everything if not any(v is r for r in ready)]
        if not pending:
            return None
        with tf.init_scope():
            flag = tf.Variable(True, trainable=False, name="matex_pending_sync")
        state.flags.append(flag)  # keep it alive with the optimizer

        def sync():
            _collectives.broadcast_variables(pending, 0)
            flag.assign(False)
            return tf.constant(True)

        with tf.control_dependencies(_last_collectives(tf.compat.v1.get_default_graph())):
            return tf.cond(flag.read_value(), sync, lambda: tf.constant(False))


def _votes(optimizer) -> bool:
    """Whether ``optimizer``'s step carries the commit vote (``_commit``): unless
    ``MATEX_COMMIT_VOTE=0``; or it is Keras's LossScaleOptimizer: non-finite gradients
    are its signal to lower the scale, decided on the reduced gradients (the same on
    every rank), so the vote must not refuse those steps for it; or it was made in a
    ``tf.distribute`` strategy's scope: its update merges the replicas, which TensorFlow
    refuses inside the vote's ``tf.cond``."""
    import keras

    return (_config.commit_vote()
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and _compat.optimizer_strategy(optimizer) is None)


def _variable_names(variables, count):
    """The variables' paths (the timeline names a fused bucket's tensors by them), or None."""
    if not variables or len(variables) != count or tf.executing_eagerly():
        return None
    return [getattr(v, "path", None) or getattr(v, "name", None) for v in variables]


_ROWS_NAME = "matex/rows"   # the rows count's entry in a fused bucket (timeline, stats)
_VOTE_NAME = "matex/vote"   # the commit vote's entry (``_commit.votes_against``)


def _rows_ride_along(grads, compression) -> Optional[tf.DType]:
    """The dtype the step's rows count can travel in, inside the dense gradients' fused
    allreduce, or None when it cannot: no dense gradient, a compressor (it may narrow
    the count), or gradients (sparse ones' values included) not all float32 or all
    float64 (float16 would overflow at gradient x rows; a count is exact in float32 up
    to 2**24 rows)."""
    present = [g for g in grads if g is not None]
    if compression is not None or not any(
            not isinstance(g, tf.IndexedSlices) for g in present):
        return None
    dtypes = {tf.as_dtype(g.values.dtype if isinstance(g, tf.IndexedSlices) else g.dtype)
              for g in present}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {tf.float32, tf.float64} else None


def _times(g, factor):
    """``g * factor`` for a dense gradient or an IndexedSlices one's values."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return tf.convert_to_tensor(g) * factor


def _over(g, total):
    """``g / total`` (0 where total is 0), dense or IndexedSlices."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.math.divide_no_nan(g.values, total), g.indices,
                                g.dense_shape)
    return tf.math.divide_no_nan(g, total)


def _weighted_average(grads, rows, threshold, names=None, variables=None, compression=None,
                      vote=True):
    """Sum over ranks of grad_r * rows_r / total rows: the global-batch gradient, and,
    with ``vote``, the step's commit vote: ``(gradients, (votes against, this rank's
    vote) or None)`` (see ``_commit``).

    One collective for the dense gradients where it can: every gradient times this
    rank's rows, the rows themselves and the vote, summed in the same fused allreduce,
    then divided by the summed rows (sparse gradients are reduced on their own, as
    always). Otherwise the rows and the vote are summed first, together, and each
    gradient is weighted before its sum.
    """
    dtype = _rows_ride_along(grads, compression)
    if dtype is not None:
        count = tf.cast(rows, dtype)
        ride = [count, _commit.votes_against(grads, dtype)] if vote else [count]
        present = [i for i, g in enumerate(grads) if g is not None]
        scaled = [_times(grads[i], count) for i in present]
        given = [names[i] for i in present] if names else [None] * len(scaled)
        held = [variables[i] for i in present] if variables else None
        # the count and the vote first: buckets are planned from the last gradient back,
        # so they travel in the last bucket, with the first layers' gradients (the last
        # ready): the vote, which reads every gradient, delays no earlier bucket
        reduced = _reduce.reduce_gradients(
            ride + scaled, [None] * len(ride) + held if held else None, None, "sum",
            threshold, [_ROWS_NAME, _VOTE_NAME][:len(ride)] + given)
        total, out = reduced[0], list(grads)
        for i, g in zip(present, reduced[len(ride):]):
            out[i] = _over(g, total)
        return out, ((reduced[1], ride[1]) if vote else None)
    ride = [tf.cast(rows, tf.float64)]
    if vote:
        ride.append(_commit.votes_against(grads, tf.float64))
    summed = _collectives.allreduce(tf.stack(ride), "sum")
    weight = tf.math.divide_no_nan(ride[0], summed[0])
    return (_reduce.reduce_gradients(grads, variables, compression, "sum", threshold, names,
                                     weight=weight), (summed[1], ride[1]) if vote else None)


class rows_of_step:
    """Within this block, ``optimizer`` weights gradients by ``rows`` (see _batch_slicing)."""

    def __init__(self, optimizer, data):
        self.state = getattr(optimizer, "_matex", None)
        self.data = data

    def __enter__(self):
        if self.state is not None:
            x = self.data[0] if isinstance(self.data, (tuple, list)) else self.data
            self.state.rows = tf.shape(tf.nest.flatten(x)[0])[0]
        return self

    def __exit__(self, *exc):
        if self.state is not None:
            self.state.rows = None

    @property
    def rows(self):
        """The rows the optimizer weights by in this block, or None (not weighted)."""
        state = self.state
        return state.rows if state is not None and state.op == "average" else None


def _last_collectives(graph):
    """The most recent MaTEx collective op in ``graph`` (as a list, maybe empty)."""
    if tf.executing_eagerly():
        return []
    for op in reversed(graph.get_operations()):
        if op.type.startswith("Matex") and op.type != "MatexCommInfo":
            return [op]
    return []


def _distributed_class(cls):
    with _classes_lock:
        if cls not in _classes:
            # Same name and module as the wrapped class, so a saved model
            # records the plain optimizer and loads without MaTEx.
            sub = type(cls.__name__, (_DistributedMixin, cls), {})
            sub.__qualname__ = cls.__qualname__
            sub.__module__ = cls.__module__
            _classes[cls] = sub
        return _classes[cls]


def _check_same_settings(optimizer, op, fusion_threshold, compression, delay):
    """``optimizer`` (already distributed) if the settings given agree with its own, else a
    ValueError naming the one that differs: a second ``DistributedOptimizer`` call (the
    script's, or ``compile``'s under ``matex.keras``) never changes nor ignores them."""
    state = optimizer._matex
    strategy = state.strategy
    from matex import _delayed

    current_delay = 1 if isinstance(strategy, _delayed.Delayed) else 0
    differs = []
    if op is not None and op != state.op:
        differs.append("op=%r (it has %r)" % (op, state.op))
    if fusion_threshold is not None and fusion_threshold != state.threshold:
        differs.append("fusion_threshold=%r (it has %r)" % (fusion_threshold, state.threshold))
    if delay is not None and delay != current_delay:
        differs.append("delay=%r (it has %r)" % (delay, current_delay))
    if compression is not None:
        wanted = _compression.from_spec(compression)
        if wanted is not state.compression and repr(wanted) != repr(state.compression):
            differs.append("compression=%r (it has %r)" % (wanted, state.compression))
    if differs:
        raise ValueError("DistributedOptimizer: this optimizer is already distributed; %s. "
                         "Wrap a fresh optimizer to change its settings"
                         % "; ".join(differs))
    return optimizer


def is_distributed(optimizer):
    """Whether ``optimizer`` already averages its gradients over ranks."""
    return isinstance(optimizer, _DistributedMixin)


def is_reduced_by_wrapper(optimizer):
    """Whether ``optimizer`` is the inner optimizer of a distributed wrapper.

    A ``LossScaleOptimizer`` (mixed precision) reduces the scaled gradients
    itself, so every rank sees the same non-finite steps and skips them
    together; its inner optimizer then applies them as they are: reducing
    again would double the traffic.
    """
    return getattr(optimizer, "_matex_reduced_by_wrapper", False)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer | type | str,
                         op: Optional[str] = None,
                         fusion_threshold: Optional[int] = None,
                         compression: Compressor | str | None = None,
                         delay: Optional[int] = None) -> keras.optimizers.Optimizer:
    """Make a Keras 3 optimizer average gradients over all ranks before updating.

    Args:
      optimizer: an optimizer instance, an optimizer class, or a name such as
        ``"adam"``. An instance is converted in place (its state is kept) and
        returned.
      op: how gradients are combined: "average" (default), "sum" or
        "adasum" (adaptive summation, per variable: ``matex.allreduce``;
        sparse gradients are made dense; no compression or delay).
      fusion_threshold: bucket size in bytes for fusing small gradients into
        one allreduce; default ``MATEX_FUSION_THRESHOLD`` or 16 MiB; 0 sends
        each gradient alone.
      compression: fewer bytes per step: a ``matex.compression`` compressor
        (``FP16``, ``BF16``, ``TopK(0.01)``, ``RandomK(0.01)``,
        ``PowerSGD(4)``), its text ("topk:0.01"), or "none"; default
        ``MATEX_COMPRESSION`` (unset: none). ``tf.IndexedSlices`` gradients
        (embeddings) always go through ``matex.sparse_allreduce``.
      delay: 0 (default) applies each step's averaged gradient at once; 1
        applies it at the next step, its non-blocking allreduce overlapping a
        whole step of compute (step 0 applies nothing; ``matex.flush``
        applies the last one; see ``matex._delayed``).

    An optimizer that is already distributed is returned as it is; an
    ``op``, ``fusion_threshold``, ``delay`` or ``compression`` given then
    must agree with its settings (a ValueError says which differs: nothing
    is silently ignored). ``delay=1``, ``LocalSGD`` and ``DiLoCo`` send
    uncompressed: a compression given or set by ``MATEX_COMPRESSION`` with
    them is a ValueError.
    Returns:
      The distributed optimizer; use it exactly like the original, with
      ``model.compile``/``fit`` or ``apply_gradients``/``apply``.

    Example:
      >>> model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
      ...               loss="sparse_categorical_crossentropy")
    """
    import keras

    if op not in (None, "average", "sum", "adasum"):
        raise ValueError("DistributedOptimizer op must be 'average', 'sum' or 'adasum', not %r"
                         % op)
    if op == "adasum" and (delay or compression not in (None, "none")):
        raise ValueError("DistributedOptimizer: op='adasum' combines whole uncompressed "
                         "gradients at once; use it without compression and delay")
    if isinstance(delay, bool) or delay not in (None, 0, 1):
        raise ValueError("DistributedOptimizer delay must be 0 (apply each step's averaged "
                         "gradient at once) or 1 (apply it one step later, its allreduce "
                         "overlapping the next step), not %r" % (delay,))
    if delay and compression not in (None, "none"):
        raise ValueError("DistributedOptimizer: delay=1 sends its gradients uncompressed; "
                         "use compression or delay, not both")
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    elif isinstance(optimizer, type):
        optimizer = optimizer()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError("DistributedOptimizer needs a Keras 3 optimizer, got %r" % (optimizer,))
    if is_distributed(optimizer):
        return _check_same_settings(optimizer, op, fusion_threshold, compression, delay)
    compressor = (_compression.from_environment() if compression is None
                  else _compression.from_spec(compression))
    if delay and compressor is not None:
        raise ValueError("DistributedOptimizer: delay=1 sends its gradients uncompressed, and "
                         "MATEX_COMPRESSION asks for %r; unset MATEX_COMPRESSION or use "
                         "delay=0" % (compressor,))
    if op == "adasum" and compressor is not None:
        raise ValueError("DistributedOptimizer: op='adasum' sends its gradients uncompressed, "
                         "and MATEX_COMPRESSION asks for %r; unset it" % (compressor,))
    _patch_keras_trainer()
    optimizer.__class__ = _distributed_class(type(optimizer))
    object.__setattr__(optimizer, "_matex", _State(op or "average", fusion_threshold))
    optimizer._matex.compression = compressor
    if compressor is not None:   # its residuals, Q and step counter
        _recovery.join(optimizer, "compressor", compressor.recovery_state)
    if delay:
        from matex import _delayed

        optimizer._matex.strategy = _delayed.Delayed()
        _recovery.join(optimizer, "delay", optimizer._matex.strategy.recovery_state)   # in flight
    inner = getattr(optimizer, "inner_optimizer", None)   # LossScaleOptimizer
    if inner is not None:
        object.__setattr__(inner, "_matex_reduced_by_wrapper", True)
    return optimizer


# ---- XLA: keep forward/backward compiled, reduce outside the cluster --------

# .active: the XLA part of a split step is being traced
_xla_part = _state.local("optimizer.xla_part")


def in_compiled_part() -> bool:
    """Whether the XLA-compiled part of a split step is being traced. No collective can run
    there: a caller with its own reduction (exact global metrics) calls
    ``defer_to_outer_step`` and returns local values; the step redoes it outside."""
    return getattr(_xla_part, "active", False)


def defer_to_outer_step() -> None:
    """Ask the split step to recompute its logs (``get_metrics_result``) outside XLA."""
    _xla_part.deferred = True


def _split_xla_step(model):
    """A train step whose compute is XLA-compiled and whose allreduce is not."""
    optimizer = model.optimizer
    state = optimizer._matex
    traced = {}  # what the XLA part produced, recorded at trace time

    def compute(data):
        state.capture = []
        _xla_part.active, _xla_part.deferred = True, False
        try:
            logs = model.train_step(data)
            captured = state.capture
            traced["deferred"] = _xla_part.deferred
        finally:
            state.capture = None
            _xla_part.active = _xla_part.deferred = False
        grads, variables = captured[0] if captured else ([], [])
        traced["present"] = [i for i, g in enumerate(grads) if g is not None]
        traced["variables"] = list(variables)
        return logs, [g for g in grads if g is not None]

    compute = tf.function(compute, jit_compile=True, reduce_retracing=True)

    def step(data):
        logs, present = compute(data)
        variables = traced["variables"]
        if variables:
            grads = [None] * len(variables)
            for i, g in zip(traced["present"], present):
                grads[i] = g
            if getattr(model, "_matex_weighted", False):
                with rows_of_step(optimizer, data):
                    optimizer.apply(grads, variables)
            else:
                optimizer.apply(grads, variables)
        if traced.get("deferred"):   # the metrics' reduction, after the update, outside XLA
            logs = model.get_metrics_result()
        return logs

    return step


def _patch_keras_trainer():
    """Route ``fit``'s step through ``_split_xla_step`` for distributed optimizers."""
    cls = _compat.tf_trainer_class()
    if getattr(cls, "_matex_patched", False):
        return
    original = cls.make_train_function

    def make_train_function(self, force=False):
        if (self.train_function is None or force) and is_distributed(
                getattr(self, "optimizer", None)) and not self.run_eagerly and self.jit_compile:
            jit = _compat.jit_compile(self)
            _compat.set_jit_compile(self, False)  # the outer step; compute inside stays XLA
            try:
                self.train_function = _compat.make_function(self, _split_xla_step(self))
            finally:
                _compat.set_jit_compile(self, jit)
            return self.train_function
        return original(self, force)

    cls.make_train_function = make_train_function
    cls._matex_patched = True
