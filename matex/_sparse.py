"""Sparse allreduce: the sum over ranks of row-sparse tensors (SparCML, arXiv 1802.08021).

Each rank brings (row index, row) pairs of a ``[rows, ...]`` tensor, like the
``tf.IndexedSlices`` gradient of an embedding. The C++ core
(``tf_ops/core/sparse.cc``) runs recursive doubling over sorted (index, row)
streams, summing rows whose indices meet at each step, and sends a stream
dense from the step where it holds ``switch_rows`` rows or more. Ranks beyond
the largest power of two fold in first. Every rank gets bitwise identical
rows.

The switch point is policy, so it is chosen here: ``density_threshold`` is
the fraction of rows at which a merged stream goes dense. By default it is
where the stream's bytes (8 bytes of index plus the row, per row) reach
``DENSE_BYTES_RATIO`` times the dense tensor's bytes; that ratio was measured
with ``benchmarks/sparse_allreduce.py`` (see there and README "Communicating
less").
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from matex import _collectives
from matex._runtime import _run_as_is

# A merged stream goes dense once its bytes reach this fraction of the dense
# tensor's bytes. Measured with benchmarks/sparse_allreduce.py (2 ranks, shared
# memory, 1 M float32 scalar rows, a 2-core VM at load 14, so rough): the
# sparse exchange stopped beating the dense allreduce between densities 0.05
# and 0.1, i.e. stream bytes 0.15-0.3 of the dense bytes (merging costs CPU
# the dense allreduce does not spend), hence 0.25: density 0.083 for scalar
# float32 rows, 0.22 for rows of 16 float32.
DENSE_BYTES_RATIO = 0.25

_INDEX_DTYPES = (tf.int32, tf.int64)


def default_density(row_elements: int, dtype: tf.DType) -> float:
    """The default switch density for rows of ``row_elements`` elements of ``dtype``."""
    row_bytes = max(int(row_elements), 0) * dtype.size
    if row_bytes == 0:
        return 1.0
    return DENSE_BYTES_RATIO * row_bytes / (8.0 + row_bytes)


def _check_threshold(density_threshold):
    if density_threshold is None:
        return
    if isinstance(density_threshold, bool) or not isinstance(density_threshold, (int, float)):
        raise TypeError("density_threshold must be a number in (0, inf] or None, not %r"
                        % (density_threshold,))
    if not density_threshold > 0:
        raise ValueError("density_threshold must be > 0 (a fraction of the rows; above 1 "
                         "never densifies), not %r" % (density_threshold,))


def _switch_rows(rows, threshold):
    """First stream length (a tensor) that travels dense."""
    rows = tf.cast(rows, tf.int64)
    if math.isinf(threshold) or threshold > 1:
        return rows + 1
    return tf.cast(tf.math.ceil(tf.cast(rows, tf.float64) * threshold), tf.int64)


def exchange(indices, values, dense_rows, density_threshold=None, comm=0):
    """The raw op: ``(indices, rows, is_dense, bytes_sent)``; see ``sparse_allreduce``.

    ``bytes_sent`` is what this rank handed to MPI (headers included).
    """
    _check_threshold(density_threshold)
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError("sparse_allreduce indices must be int32 or int64, not %s"
                        % indices.dtype.name)
    values = _collectives._as_tensor(values, "sparse_allreduce")
    if values.shape.rank == 0:
        raise ValueError("sparse_allreduce values need one row per index (rank >= 1), "
                         "got a scalar")
    indices = tf.reshape(tf.cast(indices, tf.int64), [-1])
    if density_threshold is None:
        row = values.shape[1:].num_elements()
        if row is None:
            row = 1   # unknown row shape: treat as scalar rows (the lowest default)
        density_threshold = default_density(row, values.dtype)
    rows = tf.cast(dense_rows, tf.int64)
    switch = _switch_rows(rows, float(density_threshold))
    return _collectives._issue(_collectives._ops().matex_sparse_allreduce, indices, values,
                               rows, switch, comm=int(comm))


@_run_as_is
def sparse_allreduce(indices: tf.Tensor, values: tf.Tensor,
                     dense_shape: Sequence[int] | tf.TensorShape | tf.Tensor,
                     density_threshold: float | None = None, op: str = "sum",
                     comm: int = 0) -> tf.Tensor | tf.IndexedSlices:
    """Sum (or average) over ranks of the row-sparse tensors given as (indices, values).

    Args:
      indices: int32 or int64 row ids, ``[n]``, in ``[0, dense_shape[0])``, in
        any order, duplicates allowed (summed, like ``tf.IndexedSlices``). ``n``
        may differ between ranks, and be 0.
      values: ``[n, ...row shape]``; float16, bfloat16, float32, float64,
        int32 or int64; the row shape and dtype must agree across ranks.
      dense_shape: the dense tensor's shape (its first dimension must agree
        across ranks).
      density_threshold: fraction of the rows at which the merged stream is
        sent dense; None: where its bytes reach ``DENSE_BYTES_RATIO`` of the
        dense bytes (measured default); above 1: never.
      op: "sum" (default) or "average" (the sum divided by the ranks).
      comm: the communicator slot (0: ``matex.comm()``).
    Returns:
      A ``tf.IndexedSlices`` with sorted unique indices, or, eagerly, a dense
      tensor when the result went dense. Inside ``tf.function`` the result is
      always an IndexedSlices (the dense case lists every row). Either way
      ``tf.convert_to_tensor(result)`` is the dense sum, bitwise equal on every
      rank.
    Raises:
      ValueError/TypeError for bad arguments; tf.errors.InvalidArgumentError on
      every rank if ranks disagree on dtype, row shape or rows, or if an index
      is out of range on any rank.

    Example:
      >>> total = matex.sparse_allreduce([3, 7], tf.ones([2, 4]), [10, 4])
    """
    if op not in ("sum", "average"):
        raise ValueError("sparse_allreduce op must be 'sum' or 'average', not %r" % (op,))
    dense_shape = tf.cast(tf.convert_to_tensor(dense_shape), tf.int64)
    out_indices, out_values, is_dense, _ = exchange(indices, values, dense_shape[0],
                                                    density_threshold, comm)
    if op == "average":
        size = tf.cast(_collectives.comm_info(comm)[1], out_values.dtype)
        out_values = (out_values / size if out_values.dtype.is_floating
                      else tf.truncatediv(out_values, size))   # integers truncate, as allreduce
    if tf.executing_eagerly() and bool(is_dense):
        return tf.reshape(out_values, dense_shape)
    return tf.IndexedSlices(out_values, out_indices, dense_shape)


@tf.RegisterGradient("MatexSparseAllreduce")
def _sparse_allreduce_grad(op, _g_indices, g_values, _g_dense, _g_bytes):
    # d out[i] / d values_r[j] = 1 where indices_r[j] == i, on every rank: each
    # rank's rows get the output gradient summed over ranks, at its indices.
    indices, values, rows = op.inputs[0], op.inputs[1], op.inputs[2]
    if g_values is None:
        return [None, tf.zeros_like(values), None, None]
    g_values = tf.convert_to_tensor(g_values)
    dense = tf.math.unsorted_segment_sum(g_values, op.outputs[0], rows)
    summed = _collectives._ops().matex_allreduce(dense, reduce_op="sum",
                                                 comm=op.get_attr("comm"))
    return [None, tf.gather(summed, indices), None, None]



def reduce_slices(values, indices, dense_shape, op="average", comm=0):
    """An ``IndexedSlices`` gradient reduced over ranks: ``(result, bytes sent)``.

    The result is an IndexedSlices (inside tf.function, or eagerly while
    sparse) or a dense tensor (eagerly, once dense), which Keras optimizers
    apply either way.
    """
    dense_shape = tf.cast(tf.convert_to_tensor(dense_shape), tf.int64)
    out_indices, out_values, is_dense, nbytes = exchange(indices, values, dense_shape[0],
                                                         None, comm)
    if op == "average":
        size = tf.cast(_collectives.comm_info(comm)[1], out_values.dtype)
        out_values = (out_values / size if out_values.dtype.is_floating
                      else tf.truncatediv(out_values, size))
    if tf.executing_eagerly() and bool(is_dense):
        return tf.reshape(out_values, dense_shape), nbytes
    return tf.IndexedSlices(out_values, out_indices, dense_shape), nbytes
