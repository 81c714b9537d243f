"""Collectives as TensorFlow ops, with their gradients.

The ops are stateful, so inside ``tf.function`` TensorFlow's automatic
control dependencies run them in program order: every rank traces the same
program, hence issues the same collectives in the same order, whatever order
the executor would otherwise pick. Eagerly, ops run in Python order.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import tensorflow as tf

from matex import _native, _runtime
from matex._runtime import _run_as_is
from matex.errors import mpi_error_class  # noqa: F401 - re-exported

REDUCE_OPS = ("sum", "average", "min", "max")
DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


_barriers = weakref.WeakKeyDictionary()   # graph -> op every later collective waits for


_loaded = None   # the op library, once the C++ side holds a communicator


def _ops():
    global _loaded
    if _loaded is None:
        _runtime._core()  # communicator handed to the C++ side before any op runs
        _loaded = _native.tf_ops()
    return _loaded


def set_barrier(op):
    """Make every collective created later in ``op``'s graph wait for ``op``.

    Used after a weight update, so that a later collective that fails (a dead
    peer) can never interrupt an update halfway.
    """
    _barriers[op.graph] = op


def _after_barrier():
    if tf.executing_eagerly():
        return []
    op = _barriers.get(tf.compat.v1.get_default_graph())
    return [op] if op is not None else []


def _issue(make, *args, **kwargs):
    """``make(*args, **kwargs)`` with the op after the graph's barrier, if any."""
    barrier = _after_barrier()
    if not barrier:   # eagerly, or no weight update yet in this graph: nothing to wait for
        return make(*args, **kwargs)
    with tf.control_dependencies(barrier):
        return make(*args, **kwargs)


_DTYPE_SET = frozenset(DTYPES)   # DType.__eq__ is slow Python: test membership by hash


def _as_tensor(tensor, what):
    if not isinstance(tensor, tf.Tensor):   # already a tensor: no conversion on the hot path
        tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype not in _DTYPE_SET:
        raise TypeError(
            "matex.%s does not support dtype %s (supported: %s)"
            % (what, tensor.dtype.name, ", ".join(d.name for d in DTYPES)))
    return tensor


def _check_op(op):
    if op not in REDUCE_OPS:
        raise ValueError("op must be one of %s, not %r" % (", ".join(REDUCE_OPS), op))


@_run_as_is
def allreduce(tensor: tf.Tensor, op: str = "average", name: str | None = None,
              comm: int = 0) -> tf.Tensor:
    """Reduce ``tensor`` over all ranks; every rank gets the result.

    Args:
      tensor: a tensor of float16, bfloat16, float32, float64, int32 or int64,
        of the same shape on every rank.
      op: "sum", "average" (the sum divided by the number of ranks at the time
        the op runs; integers truncate), "min" or "max".
      comm: the communicator slot (``matex._runtime.register_comm``); 0, the
        default, is the data communicator ``matex.comm()``.
    Returns:
      A tensor of the same shape and dtype.
    Raises:
      tf.errors.InvalidArgumentError on every rank if ranks disagree on shape,
      dtype or op; tf.errors.InternalError if MPI fails, carrying the MPI
      error class (``matex.mpi_error_class``).
    """
    _check_op(op)
    tensor = _as_tensor(tensor, "allreduce")
    return _issue(_ops().matex_allreduce, tensor, reduce_op=op, comm=int(comm), name=name)


@_run_as_is
def grouped_allreduce(tensors, op="average", name=None, comm=0):
    """Reduce several tensors of one dtype with one fused MPI call."""
    _check_op(op)
    tensors = [_as_tensor(t, "grouped_allreduce") for t in tensors]
    return _issue(_ops().matex_grouped_allreduce, tensors, reduce_op=op, comm=int(comm),
                  name=name)


@_run_as_is
def broadcast(tensor: tf.Tensor, root: int = 0, name: str | None = None,
              comm: int = 0) -> tf.Tensor:
    """Return rank ``root``'s ``tensor`` on every rank (same shape on all ranks)."""
    tensor = _as_tensor(tensor, "broadcast")
    return _issue(_ops().matex_broadcast, tensor, root=int(root), comm=int(comm), name=name)


@_run_as_is
def allgather(tensor: tf.Tensor, name: str | None = None, comm: int = 0) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along axis 0, in rank order.

    First dimensions may differ between ranks; the other dimensions must agree.
    """
    tensor = _as_tensor(tensor, "allgather")
    return _issue(_ops().matex_allgather, tensor, comm=int(comm), name=name)


@_run_as_is
def comm_info(comm=0):
    """(rank, size) in communicator slot ``comm``, read when the op runs."""
    return _ops().matex_comm_info(comm=int(comm))


@_run_as_is
def broadcast_variables(variables: Iterable[tf.Variable], root: int = 0, comm: int = 0) -> None:
    """Assign rank ``root``'s value to each variable, on every rank."""
    for v in variables:
        v.assign(broadcast(v, root, comm=comm))


# ---- gradients --------------------------------------------------------------

def _extreme_grad(x, y, grad, comm):
    # The result came from the ranks holding the extreme: they get the
    # gradient summed over all ranks (a subgradient when several tie).
    summed = _ops().matex_allreduce(grad, reduce_op="sum", comm=comm)
    return tf.where(tf.equal(x, y), summed, tf.zeros_like(summed))


@tf.RegisterGradient("MatexAllreduce")
def _allreduce_grad(op, grad):
    kind = op.get_attr("reduce_op").decode()
    comm = op.get_attr("comm")
    if kind in ("sum", "average"):
        return _ops().matex_allreduce(grad, reduce_op=kind, comm=comm)
    return _extreme_grad(op.inputs[0], op.outputs[0], grad, comm)


@tf.RegisterGradient("MatexGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    kind = op.get_attr("reduce_op").decode()
    comm = op.get_attr("comm")
    grads = [tf.zeros_like(x) if g is None else g for x, g in zip(op.inputs, grads)]
    if kind in ("sum", "average"):
        return _ops().matex_grouped_allreduce(grads, reduce_op=kind, comm=comm)
    return [_extreme_grad(x, y, g, comm) for x, y, g in zip(op.inputs, op.outputs, grads)]


@tf.RegisterGradient("MatexBroadcast")
def _broadcast_grad(op, grad):
    # Only the root's input reaches the output: it gets every rank's gradient.
    comm = op.get_attr("comm")
    summed = _ops().matex_allreduce(grad, reduce_op="sum", comm=comm)
    rank, _ = _ops().matex_comm_info(comm=comm)
    return tf.where(tf.equal(rank, op.get_attr("root")), summed, tf.zeros_like(summed))


@tf.RegisterGradient("MatexAllgather")
def _allgather_grad(op, grad):
    # Each rank's rows of the summed output gradient go back to that rank.
    x = op.inputs[0]
    comm = op.get_attr("comm")
    sizes = _ops().matex_allgather(tf.shape(x, out_type=tf.int64)[:1], comm=comm)
    rank, _ = _ops().matex_comm_info(comm=comm)
    offset = tf.reduce_sum(sizes[:rank])
    summed = _ops().matex_allreduce(grad, reduce_op="sum", comm=comm)
    return summed[offset:offset + sizes[rank]]


tf.no_gradient("MatexCommInfo")
