"""``DistributedOptimizer(..., delay=1)``: step t's averaged gradient is applied at step t+1.

Each step computes this rank's gradient, posts its allreduce without waiting
(``MatexIallreduceStart``: MPI_Iallreduce into a buffer the C++ core owns,
after the usual cross-rank agreement check) and applies the *previous* step's
averaged gradient, completed only now (``MatexIallreduceWait``, placed after
this step's gradients exist). So the transfer of step t overlaps the whole
forward and backward pass of step t+1 instead of stalling it; the price is
one step of staleness. Every rank applies the same completed average to the
same weights: weights stay bitwise equal across ranks after every step
(deterministic, unlike the asynchronous updates of the 2018 MaTEx, which
applied whatever had arrived).

Definitions:

* step 0 applies nothing: the inner optimizer is not called; only the step
  counter (``optimizer.iterations``) advances. Step t >= 1 applies the
  average of step t-1's gradients, through the wrapped optimizer (so Adam,
  momentum, schedules see the delayed sequence ``g_0, g_1, ...`` with
  ``iterations`` one ahead of what they would see undelayed).
* the end of training: the last step's gradient is still in flight.
  ``matex.flush(optimizer)`` (eager, on every rank) waits for it and applies
  it; without a flush it is dropped (its request is completed and discarded
  at exit, so MPI finalises cleanly).
* between steps the pending request lives in a non-trainable ``tf.Variable``
  of int64 handles (one per dtype of the gradients) held by this object, not
  by the optimizer's variables: checkpoints and saved models do not see it.
* rank failure (ULFM): the request in flight dies with its communicator; the
  recovery loop drops it (``DelayState``), and the redone step finds nothing
  pending, so that one averaged gradient is lost (its samples were trained
  on, its update never applied). Everything else is the usual recovery.

Another collective on the same communicator while a request is outstanding
(metrics, first-step broadcasts, another optimizer) is legal in MPI as long as
every rank issues them in the same order, which the stateful ops guarantee
inside a traced step (program order).
"""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

import tensorflow as tf

if TYPE_CHECKING:
    import keras

from matex import _collectives, _commit, _recovery, _state, _stats
from matex.compression._reduce import _name

_exit_hook = _state.table("delayed.exit_hook", lifetime="process", factory=list)


def _ops():
    return _collectives._ops()


def _drop_at_exit():
    # complete (and discard) what is still in flight before mpi4py finalises MPI
    try:
        if int(_ops().matex_iallreduce_pending()):
            _ops().matex_iallreduce_drop(complete=True)
    except Exception:  # noqa: BLE001 - at exit, a dead peer must not keep us here
        pass


def _cond(pred, true_fn, false_fn):
    """tf.cond in a graph, a plain ``if`` eagerly."""
    if tf.executing_eagerly():
        return true_fn() if bool(pred) else false_fn()
    return tf.cond(pred, true_fn, false_fn)


class Delayed:
    """The delay=1 path of one optimizer (see the module doc)."""

    def __init__(self):
        self.plan = None          # [(dtype, [gradient indices])], fixed at the first apply
        self.count = None         # number of gradients (None entries included)
        self.handles = None       # tf.Variable int64 [groups]: 0 = nothing pending
        self.inner_apply = None   # the wrapped optimizer's apply (for flush)
        self.variables = None
        if not _exit_hook:
            _exit_hook.append(atexit.register(_drop_at_exit))

    def _make_plan(self, grads):
        groups = {}
        for i, g in enumerate(grads):
            if g is None:
                continue
            if not g.shape.is_fully_defined():
                raise ValueError("DistributedOptimizer(delay=1) needs gradients of static "
                                 "shape; %s has shape %s" % (g.name, g.shape))
            groups.setdefault(g.dtype, []).append(i)
        self.plan = [(dtype, idx) for dtype, idx in groups.items()]
        self.shapes = [[grads[i].shape for i in idx] for _, idx in self.plan]
        self.count = len(grads)
        with tf.init_scope():
            self.handles = tf.Variable(tf.zeros([len(self.plan)], tf.int64), trainable=False,
                                       name="matex_delayed_handles")

    def _check_plan(self, grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        planned = sorted(i for _, idx in self.plan for i in idx)
        if len(grads) != self.count or present != planned:
            raise ValueError(
                "DistributedOptimizer(delay=1): this step's gradients (%d, %d present) are not "
                "those of the first step (%d, %d present); the delayed path needs the same "
                "variables at every step" % (len(grads), len(present), self.count,
                                             len(planned)))

    def _wait(self):
        """The previous step's averaged gradients (zeros if none) and whether they exist."""
        out = [None] * self.count
        valid = None
        for k, (dtype, idx) in enumerate(self.plan):
            res = _ops().matex_iallreduce_wait(self.handles[k], N=len(idx), T=dtype,
                                               shapes=self.shapes[k])
            tensors, ok = res
            valid = ok if valid is None else valid
            for i, t in zip(idx, tensors):
                out[i] = t
        return out, valid

    def _start(self, grads, op, weight):
        handles = []
        for dtype, idx in self.plan:
            tensors = [tf.convert_to_tensor(grads[i]) for i in idx]
            if weight is not None:
                tensors = [t * tf.cast(weight, t.dtype) for t in tensors]
            handles.append(_collectives._issue(_ops().matex_iallreduce_start, tensors,
                                               reduce_op=op))
        return tf.stack(handles)

    def apply(self, optimizer, grads, variables, inner_apply, op, rows):
        """Post this step's allreduce, apply the previous step's average; returns the update."""
        grads = list(grads)
        if self.plan is None:
            self._make_plan(grads)
        self._check_plan(grads)
        self.inner_apply, self.variables = inner_apply, variables
        present = [grads[i] for _, idx in self.plan for i in idx]
        weight = None
        if rows is not None and op == "average":
            # the global-batch gradient: sum of g_r * rows_r / total rows
            rows = tf.cast(rows, tf.float64)
            weight = tf.math.divide_no_nan(rows, _collectives.allreduce(rows, "sum"))
            op = "sum"
        # wait only once this step's gradients exist: the transfer overlapped them
        with tf.control_dependencies(present):
            previous, valid = self._wait()
        with tf.control_dependencies([valid]):
            started = self._start(grads, op, weight)
        # every step posts each gradient whole, in its dtype (matex.stats())
        order = [i for _, idx in self.plan for i in idx]
        sizes = [grads[i].shape.num_elements() * grads[i].dtype.size for i in order]
        _stats.record([_name(None, variables, i) for i in order], sizes, sizes)

        def update():
            inner_apply(previous, variables)
            return tf.constant(True)

        def skip():
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        def apply_or_skip():
            self.handles.assign(started)
            return _cond(valid, update, skip)

        # all-or-nothing: nothing changes before the wait and the post succeeded
        return _commit.commit(apply_or_skip, after=[started] + previous)

    def pending(self):
        """Whether a gradient is in flight (eager)."""
        return self.handles is not None and bool(tf.reduce_any(self.handles > 0))

    def flush(self):
        """Wait for the gradient in flight and apply it (eager, every rank). True if one was."""
        if not self.pending():
            return False
        with tf.init_scope():
            previous, valid = self._wait()
            self.handles.assign(tf.zeros_like(self.handles))
            if bool(valid):
                self.inner_apply(previous, self.variables)
        return bool(valid)

    def recovery_state(self, optimizer, variables) -> "DelayState":
        """Its step state (joined to the optimizer by ``DistributedOptimizer``)."""
        return DelayState(self)

    def drop(self):
        """Forget the gradient in flight (after a rank failure: it died with the communicator)."""
        if self.handles is not None:
            self.handles.assign(tf.zeros_like(self.handles))
        _ops().matex_iallreduce_drop(complete=True)


def flush(optimizer: keras.optimizers.Optimizer) -> bool:
    """Apply the gradient a ``delay=1`` optimizer still has in flight; call on every rank.

    At the end of training the last step's averaged gradient has not been
    applied yet (it is applied at the step after, which never comes). Call
    this eagerly, on every rank, after the last step to apply it; without it
    that gradient is dropped. A no-op (returns False) for other optimizers or
    when nothing is pending.
    """
    state = getattr(optimizer, "_matex", None)
    delayed = getattr(state, "strategy", None)
    if not isinstance(delayed, Delayed):
        return False
    return delayed.flush()


class DelayState(_recovery.State):
    """The recovery loop's view of a delay=1 optimizer: drop what was in flight."""

    def __init__(self, delayed):
        self.delayed = delayed

    def restore(self):
        self.delayed.drop()
