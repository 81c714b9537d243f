"""The data a loss is measured on: this rank's share, as batches, and the global row count.

Policy (the one ``fit`` follows, ``matex._batch_slicing``): arrays passed on
every rank are the *global* data set; the ranks of the communicator that
computes a loss (the whole job for a Hessian, a rank group for a point of a
loss surface) each take a contiguous block of rows. A ``tf.data.Dataset`` of
global batches is sliced batch by batch the same way; a dataset that already
holds this rank's share (``matex.shard`` or ``matex.readers``) is used as is,
which only makes sense when the communicator is the whole job.

The loss of a batch is Keras's compiled loss, a mean over the batch's rows
(the default ``sum_over_batch_size`` reduction) plus the regularisation
losses; ``model.evaluate`` weights each batch's loss by its row count. So
``sum(batch_loss * rows)`` over every rank's batches, divided by the global
row count, is ``evaluate``'s loss over all the data, whatever the batching:
this module hands out (batch, rows) and the row count it needs.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from matex import _batch_slicing


def unpack(element):
    """``(x, y, sample_weight)`` from a data element: a tuple/list of 1-3 parts, or x alone."""
    if isinstance(element, (tuple, list)):
        if not 1 <= len(element) <= 3:
            raise ValueError("data must be (x,), (x, y) or (x, y, sample_weight); got %d parts"
                             % len(element))
        return tuple(element) + (None,) * (3 - len(element))
    return element, None, None


def _rows(x) -> int:
    leaf = tf.nest.flatten(x)[0]
    return int(leaf.shape[0])


class Share:
    """This rank's share of ``data`` among ``size`` ranks of a communicator, in batches.

    ``data``: ``(x, y[, sample_weight])`` of arrays (global), a ``tf.data.Dataset``
    of global batches, or one already sharded (then ``whole_job`` must be true:
    the communicator is every rank of the job).
    """

    def __init__(self, data, rank: int, size: int, batch_size: int = 256,
                 whole_job: bool = True):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError("batch_size must be a whole number >= 1, not %r" % (batch_size,))
        self.dataset = None
        self.arrays = None
        if isinstance(data, tf.data.Dataset):
            if _batch_slicing.is_sharded(data):
                if not whole_job:
                    raise ValueError(
                        "matex.science: this dataset already holds one rank's share of the "
                        "data (matex.shard / matex.readers), but the loss is computed by a group "
                        "of ranks smaller than the job: use ranks_per_point equal to the "
                        "number of ranks, or pass arrays / a dataset of global batches")
                self.dataset = data
            else:
                self.dataset = data.map(
                    lambda *b: _slice(b if len(b) > 1 else b[0], rank, size))
            self.local_rows = None
            return
        x, y, sw = unpack(data)
        if x is None or not _batch_slicing.is_array_input(x):
            raise TypeError("matex.science: data must be (x, y[, sample_weight]) arrays or a "
                            "tf.data.Dataset, not %s" % type(data).__name__)
        parts = tuple(None if p is None else tf.nest.map_structure(np.asarray, p)
                      for p in (x, y, sw))
        n = _rows(parts[0])
        for leaf in tf.nest.flatten([p for p in parts if p is not None]):
            if leaf.shape[0] != n:
                raise ValueError("matex.science: x, y and sample_weight must have the same "
                                 "number of rows (%d vs %d)" % (n, leaf.shape[0]))
        lo, hi = _batch_slicing.slice_bounds(n, rank, size)
        self.global_rows = n
        self.local_rows = hi - lo
        self.arrays = []
        for start in range(lo, hi, batch_size):
            stop = min(start + batch_size, hi)
            self.arrays.append(tuple(
                None if p is None else tf.nest.map_structure(
                    lambda a: tf.constant(a[start:stop]), p) for p in parts))

    def batches(self):
        """This rank's batches, each ``(x, y, sample_weight)`` (re-iterable)."""
        if self.arrays is not None:
            return iter(self.arrays)
        return (unpack(element) for element in self.dataset)


def _slice(batch, rank, size):
    rows = tf.shape(tf.nest.flatten(batch)[0])[0]
    lo, hi = rows * rank // size, rows * (rank + 1) // size
    return tf.nest.map_structure(lambda t: t[lo:hi], batch)
