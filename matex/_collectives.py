"""Collectives as TensorFlow ops, with their gradients.

The ops are stateful, so inside ``tf.function`` TensorFlow's automatic
control dependencies run them in program order: every rank traces the same
program, hence issues the same collectives in the same order, whatever order
the executor would otherwise pick. Eagerly, ops run in Python order.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import tensorflow as tf

from matex._runtime import _run_as_is
from matex.errors import mpi_error_class  # noqa: F401 - re-exported
from matex._issue import (  # noqa: F401 - the layer below, its names re-exported
    DTYPES, REDUCE_OPS, _as_tensor, _barriers, _check_bool, _check_op, _issue, _ops,
    mismatch_code, set_barrier)

_NARROW_INTEGERS = (tf.int8, tf.uint8, tf.int16, tf.uint16)


def _widened(tensors, op):
    """``(tensors, dtypes)``: the narrow integer tensors of a sum, average or product as
    int32 (with their own dtypes, to cast the results back), the others as they are."""
    dtypes = [t.dtype for t in tensors]
    if op not in ("sum", "average", "product"):
        return list(tensors), dtypes
    return [tf.cast(t, tf.int32) if t.dtype in _NARROW_INTEGERS else t for t in tensors], dtypes


def _narrowed(results, dtypes):
    return [r if r.dtype == d else tf.cast(r, d) for r, d in zip(results, dtypes)]


def _reduce_one(what, tensor, op, name, comm, prescale_factor, postscale_factor):
    """One tensor through the ``matex_<what>`` reduction op: checked, then scaled if asked."""
    _check_op(op)
    tensor = _as_tensor(tensor, what)
    _check_bool(tensor, op, what)
    make = getattr(_ops(), "matex_" + what)
    (tensor,), dtypes = _widened([tensor], op)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        result = _scaled_reduce(
            lambda ts, kind: [_issue(make, ts[0], reduce_op=kind, comm=int(comm), name=name)],
            [tensor], op, prescale_factor, postscale_factor, comm)[0]
    else:
        result = _issue(make, tensor, reduce_op=op, comm=int(comm), name=name)
    return _narrowed([result], dtypes)[0]


@_run_as_is
def allreduce(tensor: tf.Tensor, op: str = "average", name: str | None = None,
              comm: int = 0, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over all ranks; every rank gets the result.

    Args:
      tensor: a tensor of float16, bfloat16, float32, float64, int32, int64,
        uint8, int8, uint16, int16 or bool, of the same shape on every rank.
      op: "sum", "average" (the sum divided by the number of ranks at the time
        the op runs; integers truncate), "min", "max" or "product" (MPI_PROD;
        its gradient is exact, with zeros too). 8- and 16-bit integers are
        reduced in int32 (Open MPI's AVX code saturates their sums): a sum or
        product wraps as C's does, an average is the exact mean, truncated;
        bool tensors take min (and), max (or) and product (and) only.
      comm: the communicator slot (``matex._runtime.register_comm``); 0, the
        default, is the data communicator ``matex.comm()``.
      prescale_factor, postscale_factor: multiply each rank's tensor before,
        and the result after, the reduction (Horovod's factors). Integer
        tensors are scaled in float64 and truncated toward zero, float16 and
        bfloat16 ones in float32; an integer "average" with a postscale factor
        scales the sum by ``postscale_factor / size`` once, as Horovod does.
    Returns:
      A tensor of the same shape and dtype.
    Raises:
      tf.errors.InvalidArgumentError on every rank if ranks disagree on shape,
      dtype or op; tf.errors.InternalError if MPI fails, carrying the MPI
      error class (``matex.mpi_error_class``).

    ``op="adasum"`` (float tensors): the adaptive sum of Maleki et al.,
    computed by vector halving over point-to-point transfers
    (``matex._adasum``, which documents the order of combination).
    """
    if op == "adasum":
        from matex import _adasum

        return _adasum.adasum(tensor, name=name, comm=comm, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor)
    return _reduce_one("allreduce", tensor, op, name, comm, prescale_factor, postscale_factor)


@_run_as_is
def grouped_allreduce(tensors: Sequence[tf.Tensor], op: str = "average", name: str | None = None,
                      comm: int = 0, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """Reduce several tensors of one dtype with one fused MPI call.

    As ``allreduce`` for each tensor (same ``op``, ``comm`` and scale factors),
    but the tensors travel together in one message.

    ``op="adasum"``: each tensor is one layer (its own dot products and norms).
    """
    if op == "adasum":
        from matex import _adasum

        return _adasum.grouped_adasum(tensors, name=name, comm=comm,
                                      prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor)
    _check_op(op)
    tensors = [_as_tensor(t, "grouped_allreduce") for t in tensors]
    if tensors:
        _check_bool(tensors[0], op, "grouped_allreduce")
    tensors, dtypes = _widened(tensors, op)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        results = _scaled_reduce(
            lambda ts, kind: _issue(_ops().matex_grouped_allreduce, ts, reduce_op=kind,
                                    comm=int(comm), name=name),
            tensors, op, prescale_factor, postscale_factor, comm)
    else:
        results = _issue(_ops().matex_grouped_allreduce, tensors, reduce_op=op, comm=int(comm),
                         name=name)
    return _narrowed(results, dtypes)


def _scale(tensor, factor):
    """``tensor * factor`` by Horovod's rule (``factor``: a number or a float64 scalar tensor).

    Integers are scaled in float64 and truncated toward zero (C's conversion),
    float16 and bfloat16 in float32, float32 and float64 in their own type.
    """
    dtype = tensor.dtype
    if dtype.is_integer:
        compute = tf.float64
    elif dtype in (tf.float16, tf.bfloat16):
        compute = tf.float32
    elif dtype.is_floating:
        compute = dtype
    else:
        raise TypeError("prescale_factor/postscale_factor do not apply to dtype %s"
                        % dtype.name)
    factor = (tf.cast(factor, compute) if isinstance(factor, tf.Tensor)
              else tf.constant(factor, compute))   # a Python float, never via float32
    scaled = tf.cast(tensor, compute) * factor
    return scaled if compute == dtype else tf.cast(scaled, dtype)


def _scaled_reduce(reduce, tensors, op, prescale, postscale, comm):
    """``reduce(tensors, op)`` between ``prescale`` and ``postscale`` (Horovod's semantics).

    An integer average with a postscale factor is a sum scaled once by
    ``postscale / size`` (size when the op runs), so that it truncates once,
    as Horovod's; otherwise the op itself averages.
    """
    if prescale != 1.0:
        tensors = [_scale(t, prescale) for t in tensors]
    integer_average = (op == "average" and postscale != 1.0
                       and any(t.dtype.is_integer for t in tensors))
    reduced = reduce(tensors, "sum" if integer_average else op)
    if postscale == 1.0:
        return list(reduced)
    if integer_average:
        _, size = comm_info(comm)
        factor = tf.constant(postscale, tf.float64) / tf.cast(size, tf.float64)
        return [_scale(r, factor) for r in reduced]
    return [_scale(r, postscale) for r in reduced]


@_run_as_is
def barrier(comm: int = 0, name: str | None = None) -> tf.Tensor:
    """Wait until every rank of communicator slot ``comm`` has reached this point.

    A collective like the others (a sum of one int32 per rank), so inside
    ``tf.function`` it runs in program order with them. Returns that sum: the
    number of ranks that took part.
    """
    return _issue(_ops().matex_allreduce, tf.constant(1, tf.int32), reduce_op="sum",
                  comm=int(comm), name=name)


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
def alltoall(tensor: tf.Tensor, splits: tf.Tensor | Sequence[int] | None = None,
             name: str | None = None, comm: int = 0) -> tuple[tf.Tensor, tf.Tensor]:
    """Send rows ``splits[j]`` of ``tensor`` (along axis 0) to rank j; receive from all.

    Rank i sends its first ``splits[0]`` rows to rank 0, the next ``splits[1]``
    to rank 1, and so on; every rank returns the rows it received,
    concatenated in rank order, and how many came from each rank.

    Args:
      tensor: a tensor of rank >= 1 of any MaTEx dtype (``DTYPES``); the first
        dimension may differ between ranks, the others must agree.
      splits: one non-negative count per rank, summing to ``tensor``'s first
        dimension; None splits it in equal parts (the first dimension must then
        divide by the number of ranks).
      comm: the communicator slot.
    Returns:
      ``(output, received_splits)``: ``output`` has the rows received (their
      sum is its first dimension); ``received_splits`` (int32) has one count
      per rank. The gradient is the alltoall of the output's gradient back
      with ``received_splits``.
    Raises:
      tf.errors.InvalidArgumentError on every rank, with one message naming
      each offending rank, when some rank's splits are wrong (count, sign,
      sum, an unequal default split) or ranks disagree on dtype or the
      dimensions after the first.
    """
    tensor = _as_tensor(tensor, "alltoall")
    if splits is None:
        splits = tf.zeros([0], tf.int64)   # empty: equal parts (decided in the op)
    else:
        splits = tf.cast(splits, tf.int64)
    output, received = _issue(_ops().matex_alltoall, tensor, splits, comm=int(comm), name=name)
    return output, received


@_run_as_is
def reducescatter(tensor: tf.Tensor, op: str = "average", name: str | None = None,
                  comm: int = 0, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's part of axis 0.

    Rank r gets rows ``[r*q + min(r, m), ...)`` of the reduced tensor, ``q + 1``
    of them if ``r < m`` else ``q``, where ``q, m = divmod(n, size)`` for ``n``
    rows (Horovod's split: the first ``n % size`` ranks get one more row).

    Args:
      tensor: a tensor of rank >= 1, of the same shape and dtype on every rank.
      op: "sum", "average" (integers truncate), "min", "max" or "product";
        bool tensors take min, max and product.
      comm: the communicator slot.
      prescale_factor, postscale_factor: as in ``allreduce`` (Horovod's factors).
    Returns:
      A tensor with this rank's rows. The gradient of "sum" is the allgather
      of the output gradients (every rank's loss counted), divided by the
      size for "average".
    Raises:
      tf.errors.InvalidArgumentError on every rank if ranks disagree on shape,
      dtype or op, or for a scalar.
    """
    return _reduce_one("reducescatter", tensor, op, name, comm, prescale_factor,
                       postscale_factor)


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


def _others_product(x, comm):
    """Per element, the product over the other ranks of their ``x`` (exact with zeros).

    From the product of the nonzero entries and the count of zeros: an element
    that is 0 here gets that product if it is the only zero, else 0; a nonzero
    one gets the full product divided by itself.
    """
    zero = tf.equal(x, 0)
    one = tf.ones_like(x)
    zeros = _ops().matex_allreduce(tf.cast(zero, x.dtype), reduce_op="sum", comm=comm)
    nonzero = _ops().matex_allreduce(tf.where(zero, one, x), reduce_op="product", comm=comm)
    none = tf.zeros_like(x)
    return tf.where(zero, tf.where(tf.equal(zeros, 1), nonzero, none),
                    tf.where(tf.equal(zeros, 0), nonzero / tf.where(zero, one, x), none))


@tf.RegisterGradient("MatexAllreduce")
def _allreduce_grad(op, grad):
    kind = op.get_attr("reduce_op").decode()
    comm = op.get_attr("comm")
    if kind in ("sum", "average"):
        return _ops().matex_allreduce(grad, reduce_op=kind, comm=comm)
    if kind == "product":   # every rank's loss: the summed gradient times the others' product
        summed = _ops().matex_allreduce(grad, reduce_op="sum", comm=comm)
        return summed * _others_product(op.inputs[0], comm)
    return _extreme_grad(op.inputs[0], op.outputs[0], grad, comm)


@tf.RegisterGradient("MatexGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    kind = op.get_attr("reduce_op").decode()
    comm = op.get_attr("comm")
    grads = [tf.zeros_like(x) if g is None else g for x, g in zip(op.inputs, grads)]
    if kind in ("sum", "average"):
        return _ops().matex_grouped_allreduce(grads, reduce_op=kind, comm=comm)
    if kind == "product":
        summed = _ops().matex_grouped_allreduce(grads, reduce_op="sum", comm=comm)
        return [s * _others_product(x, comm) for x, s in zip(op.inputs, summed)]
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


@tf.RegisterGradient("MatexAlltoall")
def _alltoall_grad(op, grad, _received_splits_grad):
    # Each received row's gradient goes back to the rank that sent it.
    back, _ = _ops().matex_alltoall(grad, tf.cast(op.outputs[1], tf.int64),
                                    comm=op.get_attr("comm"))
    return [back, None]


@tf.RegisterGradient("MatexReducescatter")
def _reducescatter_grad(op, grad):
    # Rank r's output rows depend on every rank's rows of that part: each rank
    # gets the gradients of all parts, in rank order (an allgather).
    kind = op.get_attr("reduce_op").decode()
    comm = op.get_attr("comm")
    full = _ops().matex_allgather(grad, comm=comm)
    x = op.inputs[0]
    if kind == "sum":
        return full
    if kind == "average":
        _, size = _ops().matex_comm_info(comm=comm)
        return full / tf.cast(size, full.dtype)
    if kind == "product":
        return full * _others_product(x, comm)
    y = _ops().matex_allgather(op.outputs[0], comm=comm)   # min, max: the holders of the extreme
    return tf.where(tf.equal(x, y), full, tf.zeros_like(full))


tf.no_gradient("MatexCommInfo")
