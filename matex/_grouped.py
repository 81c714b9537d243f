"""Grouped allgather and reducescatter: several tensors, few messages.

``grouped_allgather`` sends, per dtype, one allgather of every tensor
flattened and concatenated, after one small allgather of each rank's shapes
(which also checks that ranks agree on the group: same count, dtypes and
trailing dimensions, else ``tf.errors.InvalidArgumentError`` on every rank,
before any data moves). ``grouped_reducescatter`` is one
``matex.reducescatter`` per dtype over the tensors laid out rank by rank.

Both are compositions of MaTEx's differentiable collectives and TensorFlow
ops, so their gradients follow from those of ``allgather`` (each rank's rows
of the gradient summed over ranks) and ``reducescatter`` (the allgather of the
gradients; divided by the size for "average").
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from matex import _collectives
from matex._runtime import _run_as_is

__all__ = ["grouped_allgather", "grouped_reducescatter"]

MAX_DIMS = 8   # dimensions of a tensor in a group (the shapes travel padded to this)
_META = 3 + MAX_DIMS   # per tensor: group size, dtype, ndim, dimensions


def _by_dtype(tensors):
    """Indices of ``tensors`` per dtype, dtypes in order of first appearance."""
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _check_ranks(tensors, what):
    for t in tensors:
        ndim = t.shape.rank
        if ndim is None or not 1 <= ndim <= MAX_DIMS:
            raise ValueError("matex.%s needs tensors of 1 to %d dimensions, not %s"
                             % (what, MAX_DIMS, "an unknown number" if ndim is None else ndim))


def _shape_rows(tensors):
    """This rank's description of the group: one int64 row of ``_META`` per tensor."""
    n = len(tensors)
    rows = []
    for t in tensors:
        shape = tf.shape(t, out_type=tf.int64)
        head = tf.constant([n, t.dtype.as_datatype_enum, t.shape.rank], tf.int64)
        rows.append(tf.concat([head, tf.pad(shape, [[0, MAX_DIMS - t.shape.rank]])], 0))
    return tf.stack(rows)


@_run_as_is
def grouped_allgather(tensors: Sequence[tf.Tensor], name: str | None = None,
                      comm: int = 0) -> list[tf.Tensor]:
    """``[matex.allgather(t) for t in tensors]``, in one message per dtype.

    Each tensor is concatenated along axis 0 over the ranks of slot ``comm``,
    in rank order; first dimensions may differ between ranks, the others must
    agree, and every rank passes the same number of tensors with the same
    dtypes (1 to 8 dimensions each).

    Raises:
      tf.errors.InvalidArgumentError: on every rank, if ranks disagree on the
        group (count, dtypes, ranks or trailing dimensions).
    """
    tensors = [_collectives._as_tensor(t, "grouped_allgather") for t in tensors]
    if not tensors:
        return []
    _check_ranks(tensors, "grouped_allgather")
    with tf.name_scope(name or "grouped_allgather"):
        mine = _shape_rows(tensors)
        n = len(tensors)
        gathered = _collectives.allgather(mine, comm=comm)   # [size * n_r summed, _META]
        # The same test on every rank (all see the same rows): the group agrees.
        agree = tf.reduce_all(tf.equal(gathered[:, 0], n))
        agree = tf.logical_and(agree, tf.equal(tf.shape(gathered, out_type=tf.int64)[0] % n, 0))
        ok = tf.debugging.Assert(agree, ["matex.grouped_allgather: ranks pass different "
                                         "numbers of tensors"])
        with tf.control_dependencies([ok]):
            table = tf.reshape(gathered, [-1, n, _META])        # [size, n, _META]
        same = tf.reduce_all(tf.equal(table[:, :, 1:3], table[:1, :, 1:3]))
        same = tf.logical_and(same, tf.reduce_all(tf.equal(table[:, :, 4:], table[:1, :, 4:])))
        ok = tf.debugging.Assert(same, ["matex.grouped_allgather: ranks disagree on the "
                                        "dtypes, ranks or trailing dimensions of the group"])
        dims = table[:, :, 3:]                                    # padded with zeros
        used = tf.range(MAX_DIMS, dtype=tf.int64) < table[:, :, 2:3]
        elements = tf.reduce_prod(tf.where(used, dims, tf.ones_like(dims)), axis=2)  # [size, n]
        out = [None] * n
        for group in _by_dtype(tensors):
            with tf.control_dependencies([ok]):
                flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in group], 0)
            data = _collectives.allgather(flat, comm=comm)
            counts = tf.gather(elements, group, axis=1)          # [size, len(group)]
            ends = tf.reshape(tf.cumsum(tf.reshape(counts, [-1])), tf.shape(counts))
            starts = ends - counts
            for j, i in enumerate(group):
                index = tf.ragged.range(starts[:, j], ends[:, j]).flat_values
                rows = tf.gather(data, index)
                trailing = tf.shape(tensors[i])[1:]
                out[i] = tf.reshape(rows, tf.concat([[-1], trailing], 0))
                out[i].set_shape([None] + tensors[i].shape[1:].as_list())
    return out


def _blocks(tensor, size):
    """``tensor`` as ``[size, q + 1, ...]``: block r holds rank r's rows, zero-padded.

    Rank r's rows are Horovod's split of axis 0: ``q + (r < m)`` rows from
    ``r*q + min(r, m)``, where ``q, m = divmod(rows, size)``. Also returns the
    per-rank row count ``q + 1`` and this split's ``(q, m)``.
    """
    rows = tf.shape(tensor, out_type=tf.int32)[0]
    base, extra = rows // size, rows % size
    ranks = tf.range(size)[:, None]
    k = tf.range(base + 1)[None, :]
    index = ranks * base + tf.minimum(ranks, extra) + k
    valid = k < base + tf.cast(ranks < extra, tf.int32)            # [size, q + 1]
    taken = tf.gather(tensor, tf.where(valid, index, tf.zeros_like(index)))
    mask = tf.reshape(valid, tf.concat([tf.shape(valid), tf.ones([tf.rank(tensor) - 1],
                                                                   tf.int32)], 0))
    return tf.where(mask, taken, tf.zeros_like(taken)), base, extra


def _fused_reducescatter(tensors, op, comm, rank, size):
    """One ``matex.reducescatter`` for same-dtype ``tensors``: this rank's rows of each.

    Each tensor is laid out as one padded block of rows per rank; the blocks
    of all tensors are concatenated per rank, so rank r's share of the single
    reduce-scatter is its rows of every tensor (padding rows dropped after).
    """
    laid, widths, splits = [], [], []
    for t in tensors:
        blocks, base, extra = _blocks(t, size)
        flat = tf.reshape(blocks, [size, -1])
        laid.append(flat)
        widths.append(tf.shape(flat)[1])
        splits.append((blocks, base, extra))
    mine = _collectives.reducescatter(tf.concat(laid, 1), op=op, comm=comm)   # [1, total]
    parts = tf.split(mine[0], tf.stack(widths), num=len(tensors))
    out = []
    for t, part, (blocks, base, extra) in zip(tensors, parts, splits):
        rows = tf.reshape(part, tf.shape(blocks)[1:])
        count = base + tf.cast(rank < extra, tf.int32)
        own = rows[:count]
        own.set_shape([None] + t.shape[1:].as_list())
        out.append(own)
    return out


@_run_as_is
def grouped_reducescatter(tensors: Sequence[tf.Tensor], op: str = "average",
                          name: str | None = None, comm: int = 0,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """``[matex.reducescatter(t, op) for t in tensors]``, in one message per dtype.

    Tensors have the same shape on every rank (at least one dimension). Rank
    ``r`` of ``size`` gets rows ``[r*q + min(r, m), ...)`` of each reduced
    tensor, ``q + (r < m)`` of them, where ``q, m = divmod(rows, size)``
    (Horovod's split). ``op``, ``prescale_factor`` and ``postscale_factor`` as
    in ``matex.allreduce``. Per dtype, the tensors travel in one
    reduce-scatter (each padded by at most one row per rank).
    """
    _collectives._check_op(op)
    tensors = [_collectives._as_tensor(t, "grouped_reducescatter") for t in tensors]
    if not tensors:
        return []
    _check_ranks(tensors, "grouped_reducescatter")
    with tf.name_scope(name or "grouped_reducescatter"):
        out = [None] * len(tensors)
        rank, size = _collectives.comm_info(comm)
        for group in _by_dtype(tensors):
            members = [tensors[i] for i in group]
            if prescale_factor != 1.0 or postscale_factor != 1.0:
                reduced = _collectives._scaled_reduce(
                    lambda ts, kind: _fused_reducescatter(ts, kind, comm, rank, size),
                    members, op, prescale_factor, postscale_factor, comm)
            else:
                reduced = _fused_reducescatter(members, op, comm, rank, size)
            for i, r in zip(group, reduced):
                out[i] = r
    return out
