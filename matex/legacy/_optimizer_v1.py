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


class AccumulatingOptimizerV1(DistributedOptimizerV1):
    """Horovod's TF1 ``backward_passes_per_step=N``: gradients accumulate locally in
    variables on every call; every N-th call reduces them (divided by N with
    ``average_aggregated_gradients``) and applies them with the wrapped optimizer;
    the other calls only advance ``global_step`` (Horovod's
    ``LocalGradientAggregationHelper`` semantics).

    The accumulators and the call counter are local variables
    (``tf.compat.v1.GraphKeys.LOCAL_VARIABLES``, as in Horovod: run
    ``local_variables_initializer``, ``MonitoredTrainingSession`` does). The one
    grouped reduction sits in a control flow v2 cond (an ``If`` op), not a v1
    ``tf.cond``: the graph scheduler accepts it as the only collective of its run.
    Gradients are made dense (``IndexedSlices`` accumulate as dense tensors).
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, reduce: Reduce,
                 passes: int, average: bool, name: str | None = None) -> None:
        super().__init__(optimizer, reduce, name=name)
        self._passes = int(passes)
        self._average = bool(average)
        self._counter = None

    def _local(self, name: str, initial: Any) -> Any:
        return tf.compat.v1.Variable(
            initial, name=name, trainable=False,
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """Accumulate this call's gradients; every N-th call they come back reduced."""
        from matex import _compat

        token = reducing.set(True)
        try:
            pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        finally:
            reducing.reset(token)
        at = [i for i, (g, _) in enumerate(pairs) if g is not None]
        if not at:
            return pairs
        grads = [tf.convert_to_tensor(pairs[i][0]) for i in at]
        variables = [pairs[i][1] for i in at]
        with tf.init_scope():
            if self._counter is None:
                self._counter = self._local("matex_aggregation_counter",
                                            tf.constant(0, tf.int32))
            accumulators = [self._local("matex_aggregated_%d" % n,
                                        tf.zeros(g.shape.as_list(), g.dtype))
                            for n, g in enumerate(grads)]
        first = tf.equal(self._counter, 0)
        added = [acc.assign(tf.where(first, g, acc.read_value() + g))
                 for acc, g in zip(accumulators, grads)]
        with tf.control_dependencies(added):
            count = self._counter.assign_add(1)
        passes, average = self._passes, self._average

        def reduced():
            out = self._reduce([tf.identity(a) for a in added], variables)
            return [o / passes if average else o for o in out]

        def kept():
            return [tf.identity(g) for g in grads]

        out = _compat.cond_v2(tf.equal(count, passes), reduced, kept)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        with tf.control_dependencies(out):
            self._reset = self._counter.assign(tf.math.floormod(count, passes))
        with tf.control_dependencies([self._reset]):
            out = [tf.identity(o) for o in out]
        mark_reduced(out)
        for i, g in zip(at, out):
            pairs[i] = (g, pairs[i][1])
        return pairs

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        """The wrapped optimizer's apply on every N-th call; else ``global_step += 1``."""
        if self._counter is None:
            raise ValueError("apply_gradients before compute_gradients: with "
                             "backward_passes_per_step > 1 the gradients must come from "
                             "this optimizer's compute_gradients")
        grads_and_vars = list(grads_and_vars)
        inputs = [g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies([self._reset] + [
                g.values if isinstance(g, tf.IndexedSlices) else g for g in inputs]):
            now = tf.equal(self._counter.read_value(), 0)

        def apply():
            token = reducing.set(True)
            try:
                op = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                     name=name)
            finally:
                reducing.reset(token)
            return tf.group(op)

        def skip():
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.ones([], global_step.dtype)))

        return tf.cond(now, apply, skip)


def horovod_optimizer(optimizer: tf.compat.v1.train.Optimizer, reduction: Any,
                      what: str = "DistributedOptimizer") -> DistributedOptimizerV1:
    """Horovod's TF1 ``DistributedOptimizer``: ``reduction`` (a
    ``matex.horovod._training.HorovodReduction``) reduces each ``compute_gradients``.

    The optimizer gains Horovod's ``register_local_var(var)``.
    """
    if reduction.passes != 1:
        wrapped = AccumulatingOptimizerV1(optimizer, reduction.reduce, reduction.passes,
                                          reduction.average_aggregated)
    else:
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
