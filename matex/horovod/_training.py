"""Horovod's training options on MaTEx's optimizer and tape.

``backward_passes_per_step`` (local gradient accumulation), ``sparse_as_dense``
and local (not reduced) variables, as Horovod's ``DistributedOptimizer``,
``DistributedGradientTape`` and their ``Partial`` variants have them.

Horovod's semantics, followed here:

* accumulation (``backward_passes_per_step=N``): each call adds this rank's
  gradients to local accumulators; the N-th call allreduces the sums once,
  divides them by N when ``average_aggregated_gradients``, applies them and
  zeroes the accumulators. The other calls apply nothing and only advance
  ``optimizer.iterations`` (so ``iterations`` counts every call, as in
  Horovod). ``IndexedSlices`` gradients need ``sparse_as_dense=True`` then
  (Horovod's ValueError otherwise).
* local variables (``register_local_var``, ``local_layers=``): their gradients
  are not reduced; with ``scale_local_gradients`` (the default) they are
  divided by the number of ranks, as Horovod does (horovod pull 3695).
* ``sparse_as_dense``: ``IndexedSlices`` gradients are made dense before the
  reduction (one dense allreduce instead of MaTEx's sparse allreduce).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from matex import _collectives, _commit, _compat, _recovery, _runtime, _tape
from matex.compression import _reduce
from matex.horovod import _api, _join


# Python that builds ops: autograph (a tf.function's default) would convert it, and
# everything it calls, on every trace (seconds), for nothing
_no_autograph = tf.autograph.experimental.do_not_convert


def _cond(pred, true_fn, false_fn):
    """tf.cond in a graph, a plain ``if`` eagerly."""
    if tf.executing_eagerly():
        return true_fn() if bool(pred) else false_fn()
    return tf.cond(pred, true_fn, false_fn)


def _divide(grad, divisor):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(divisor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad / tf.cast(divisor, grad.dtype)


class HorovodReduction:
    """How one optimizer or tape reduces its gradients (Horovod's options, see module doc)."""

    def __init__(self, op: str = "average", compressor: Any = None,
                 sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, local_layers: Any = (),
                 scale_local_gradients: bool = True, threshold: int | None = None) -> None:
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step <= 0):
            raise ValueError("backward_passes_per_step must be > 0")
        self.op = op
        self.compressor = compressor
        self.sparse_as_dense = bool(sparse_as_dense)
        self.passes = backward_passes_per_step
        self.average_aggregated = bool(average_aggregated_gradients)
        self.local_layers = list(local_layers)
        self.local_vars: list = []
        self.scale_local = bool(scale_local_gradients)
        self.threshold = threshold
        self.accumulators: dict[int, tf.Variable] = {}
        self.counter: tf.Variable | None = None

    # ---- local variables ----------------------------------------------------

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced)."""
        if not any(var is v for v in self.local_vars):
            self.local_vars.append(var)

    def _local_ids(self) -> set[int]:
        ids = {id(v) for v in self.local_vars}
        for layer in self.local_layers:   # read now: a layer may be built after wrapping
            ids.update(id(v) for v in layer.trainable_weights)
        return ids

    def is_local(self, var: Any) -> bool:
        """Whether ``var``'s gradient stays on this rank."""
        return id(var) in self._local_ids()

    # ---- the reduction --------------------------------------------------------

    @_no_autograph
    def reduce(self, grads: list, variables: list | None) -> list:
        """``grads`` reduced over ranks, local variables' gradients kept (scaled)."""
        grads = list(grads)
        if self.sparse_as_dense or self.op == "adasum":
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        variables = list(variables) if variables is not None else None
        announced = _join.announce_gradients(self, grads, variables)   # for hvd.join()
        if announced is not None and not tf.executing_eagerly():
            with tf.control_dependencies([announced]):
                grads = [tf.identity(g) if isinstance(g, tf.Tensor) else g for g in grads]
        local = self._local_ids() if variables is not None else set()
        shared = [i for i in range(len(grads))
                  if variables is None or id(variables[i]) not in local]
        reduced = _reduce.reduce_gradients(
            [grads[i] for i in shared],
            [variables[i] for i in shared] if variables is not None else None,
            self.compressor, self.op, self.threshold)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local and len(shared) < len(grads):
            size = _collectives.comm_info()[1]
            for i in range(len(grads)):
                if id(variables[i]) in local:
                    out[i] = _divide(out[i], size)
        return out

    # ---- the optimizer's step (matex._optimizer's strategy interface) ---------

    @_no_autograph
    def apply(self, optimizer: Any, grads: list, variables: list | None, inner_apply: Any,
              op: str, rows: Any) -> Any:
        """Reduce (every N-th call) and apply; the other calls accumulate and count."""
        if variables is None:
            variables = list(_compat.optimizer_trainable_variables(optimizer))
        if self.passes == 1:
            reduced = self.reduce(grads, variables)
            return _commit.commit(lambda: inner_apply(reduced, variables), after=reduced)
        summed = self.accumulate(grads, variables)

        def reduce_and_apply():
            reduced = self.finish(summed, variables)
            inner_apply(reduced, variables)
            self.clear()
            return tf.constant(True)

        def count_only():
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return _commit.commit(lambda: _cond(self.due(), reduce_and_apply, count_only),
                              after=[g for g in summed if g is not None])

    # ---- accumulation --------------------------------------------------------

    def accumulate(self, grads: list, variables: list | None) -> list:
        """Add ``grads`` to the accumulators and count the call; returns the sums so far."""
        out = []
        counter = self._counter()
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("IndexedSlices are not supported when "
                                     "`backward_passes_per_step` > 1 and `sparse_as_dense` is "
                                     "False.")
                g = tf.convert_to_tensor(g)
            shape = variables[i].shape if variables is not None else g.shape
            out.append(self._accumulator(i, shape, g.dtype).assign_add(g))
        with tf.control_dependencies([t for t in out if t is not None]):
            counter.assign_add(1)
        return out

    def _counter(self) -> tf.Variable:
        """The call counter, made at first use (outside any function being traced)."""
        with tf.init_scope():
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="matex_backward_passes")
        return self.counter

    def _accumulator(self, i: int, shape: Any, dtype: Any) -> tf.Variable:
        """Gradient ``i``'s accumulator, made (zeros) at first use."""
        if i not in self.accumulators:
            with tf.init_scope():
                self.accumulators[i] = tf.Variable(tf.zeros(shape, dtype), trainable=False,
                                                   name="matex_accumulated_gradient")
        return self.accumulators[i]

    def load(self, counter: int, accumulators: dict) -> None:
        """Set the counter and the accumulators (``{index: array}``), making those missing:
        a restarted process's, from a commit on disk, before its first call."""
        self._counter().assign(counter)
        for i, value in accumulators.items():
            self._accumulator(int(i), value.shape, tf.as_dtype(value.dtype)).assign(value)

    def due(self) -> tf.Tensor:
        """Whether this call is the N-th (the counter is read after this call's increment).

        At N or past it: a counter a failed call left past N still fires (equality
        alone would never fire again, and updates would stop with no error).
        """
        return tf.greater_equal(self.counter.read_value(), self.passes)

    def recovery_state(self, optimizer: Any) -> Any:
        """The counter and accumulators as a recovery-loop state (``AccumulationState``)."""
        return AccumulationState(self, optimizer)

    def finish(self, summed: list, variables: list | None) -> list:
        """The accumulated gradients reduced over ranks (divided by N if asked)."""
        reads = [self.accumulators[i].read_value() if g is not None else None
                 for i, g in enumerate(summed)]
        reduced = self.reduce(reads, variables)
        if self.average_aggregated:
            reduced = [_divide(g, self.passes) for g in reduced]
        return reduced

    def clear(self) -> None:
        """Zero the accumulators and the counter (after the N-th call)."""
        for acc in self.accumulators.values():
            acc.assign(tf.zeros_like(acc))
        self.counter.assign(0)


class AccumulationState(_recovery.SnapshotState):
    """``backward_passes_per_step``'s counter and accumulators under the recovery loop.

    A call that a rank failure interrupts may have added its gradients and counted
    itself before its update was committed: ``begin_step`` snapshots the counter and the
    accumulators, ``restore`` puts them back when the optimizer's iterations did not move
    (the call's work was not committed on this rank; those made since are zeroed).
    ``sync`` takes ``root``'s counter, so every survivor reduces at the same call;
    the accumulators are each rank's own gradients and stay.
    """

    def __init__(self, reduction: HorovodReduction, optimizer: Any) -> None:
        self.reduction, self.optimizer = reduction, optimizer
        super().__init__(self._variables, lambda: int(optimizer.iterations))

    def _variables(self) -> list:
        r = self.reduction
        return ([r.counter] if r.counter is not None else []) + list(r.accumulators.values())

    def sync(self, root: int = 0) -> None:
        # made where missing (a rank that has not run a call yet), so every rank joins
        _collectives.broadcast_variables([self.reduction._counter()], root)

    def arrays(self) -> list:
        counter = self.reduction.counter
        return [counter.numpy()] if counter is not None else []

    def committed(self) -> Any:
        """The counter and the ranks' accumulators summed, at the commit (the last
        ``begin_step``), for a commit written to disk (collective): a restarted job goes
        on accumulating from there. A rank that has not made an accumulator yet adds
        zeros."""
        r, control = self.reduction, _runtime.control()
        mine = {i: self.snapshot_of(a) for i, a in r.accumulators.items()}
        counter = int(self.snapshot_of(r.counter)) if r.counter is not None else 0
        # one allgather: the counter (the same wherever made) and which accumulators exist
        everyone = control.allgather(
            (counter, {i: (v.shape, v.dtype.str) for i, v in mine.items()}))
        layout: dict = {}
        for _, held in everyone:
            layout.update(held)
        sums = {i: control.allreduce(mine[i] if i in mine else np.zeros(shape, dtype))
                for i, (shape, dtype) in sorted(layout.items())}
        return {"counter": max(c for c, _ in everyone), "sums": sums,
                "ranks": control.Get_size(), "op": r.op}

    def load_committed(self, data: Any) -> None:
        """The resuming rank holds the sums, the others start from zero: the next reduction
        adds the committed part once. With an average it is scaled by the ranks now over
        the ranks then, so it weighs what it weighed in the job that committed it."""
        scale = 1 if data["op"] == "sum" else _runtime.size() / data["ranks"]
        self.reduction.load(data["counter"], {i: s * scale for i, s in data["sums"].items()})
        self.begin_step()   # the loaded values are the commit to go back to


class _HorovodTapeMixin:
    """``gradient`` reduces through the tape's ``HorovodReduction``."""

    _hvd: HorovodReduction

    @_no_autograph
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        variables = tf.nest.flatten(sources, expand_composites=False)
        reduced = self._hvd.reduce(flat, variables if len(variables) == len(flat) else None)
        return tf.nest.pack_sequence_as(grads, reduced)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank (Horovod's name on the tape)."""
        self._hvd.register_local_var(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``([(local source, gradient)], [(shared source, reduced gradient)])``."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        pairs = list(zip(sources, grads))
        return ([p for p in pairs if self._hvd.is_local(p[0])],
                [p for p in pairs if not self._hvd.is_local(p[0])])


def horovod_tape(tape: tf.GradientTape, reduction: HorovodReduction) -> tf.GradientTape:
    """``tape`` (converted in place) whose ``gradient`` reduces as ``reduction`` says."""
    _tape.mix_in(tape, _HorovodTapeMixin)
    tape._hvd = reduction
    return tape


# ---- Horovod's training options checked, and a reduction within a process set ----

def training_op(op: int, what: str) -> str:
    if op not in (_api.Average, _api.Sum, _api.Adasum):
        raise NotImplementedError("%s: only hvd.Average, hvd.Sum and hvd.Adasum are supported "
                                  "by matex, not %s" % (what, _api._OP_NAMES.get(op, op)))
    return _api._OP_NAMES[op]


def check_training_args(what: str, backward_passes_per_step: int = 1,
                         gradient_predivide_factor: float = 1.0, op: int = _api.Average,
                         num_groups: int = 0, groups: Any = None, process_set: Any = None,
                         sparse_as_dense: bool = False,
                         average_aggregated_gradients: bool = False) -> None:
    """Horovod options MaTEx has no equivalent for: a NotImplementedError naming them."""
    _api._no_process_set(process_set)
    if (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step <= 0):
        raise ValueError("backward_passes_per_step must be > 0")
    if gradient_predivide_factor != 1.0 and op != _api.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if groups is not None or num_groups:
        import logging

        logging.getLogger(__name__).info(
            "%s: groups/num_groups ignored: MaTEx fuses gradients by size "
            "(MATEX_FUSION_THRESHOLD)", what)


def compression_spec(compression: Any) -> Any:
    from matex.horovod._compression import as_matex_compressor

    return as_matex_compressor(compression)


def reduce_within(reduction: Any, process_set: Any) -> Any:
    """Make ``reduction`` (an optimizer's or tape's ``HorovodReduction``) reduce over
    ``process_set`` only, as Horovod's ``process_set=`` does; returns it.

    On the set's members the gradients are averaged (or summed) over the set's
    communicator slot, local variables' gradients kept (divided by the set's size
    with ``scale_local_gradients``); a rank outside the set keeps its own gradients.
    No compression within a process set.
    """
    if process_set is None or process_set.process_set_id == 0:
        return reduction
    op = {"average": _api.Average, "sum": _api.Sum, "adasum": _api.Adasum}[reduction.op]

    def reduce(grads: list, variables: list | None) -> list:
        grads = list(grads)
        if not process_set.included():
            return grads
        local = reduction._local_ids() if variables is not None else set()
        out: list[Any] = list(grads)
        dense = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if variables is not None and id(variables[i]) in local:
                if reduction.scale_local:
                    out[i] = g / tf.cast(_api._set_size(process_set), g.dtype)
                continue
            if isinstance(g, tf.IndexedSlices) and (reduction.sparse_as_dense or op == _api.Adasum):
                g = tf.convert_to_tensor(g)
            if isinstance(g, tf.IndexedSlices):
                out[i] = _api.allreduce(g, op=op, process_set=process_set)
            else:
                dense.append(i)
        reduced = _api.grouped_allreduce([grads[i] if not isinstance(grads[i], tf.IndexedSlices)
                                          else tf.convert_to_tensor(grads[i]) for i in dense],
                                         op=op, process_set=process_set)
        for i, r in zip(dense, reduced):
            out[i] = r
        return out

    reduction.reduce = reduce
    return reduction
