"""Batches gathered one at a time inside tf.data, for tables read row by row.

Data read row by row (contiguous HDF5, netCDF classic: memory maps) need no
read-ahead cache, so no Python generator either: the dataset is
``range(steps)`` mapped, in parallel, through a gather of batch ``i`` of the
epoch's plan. A field stored as the batch needs it (a mapped float32 feature,
an int64 or float32 label) is gathered with ``np.take(..., out=)`` (no GIL
held) straight from the page cache into a buffer that TensorFlow then takes
over without a copy (numpy_function borrows 64-byte aligned arrays). Buffers
come back to a small pool once TensorFlow drops them, so wide batches do not
page-fault fresh memory every step. Other fields go through the table's own
gather and conversion, as the generator path does.
"""

import sys
import threading

import numpy as np

from matex import timeline

from ._errors import ReaderError
from ._mapped import MappedColumn
from ._table import ColumnTable

_ALIGN = 64             # TensorFlow borrows NumPy memory aligned to this (EIGEN_MAX_ALIGN_BYTES)
_PLANS_KEPT = 2         # epochs whose plans stay readable (an iterator and its successor)
_GROUP_BYTES = 256 << 10
_MOST_GROUPED = 16
_EPOCH_STRIDE = 1 << 32     # a batch's key: its epoch's token times this, plus its number


def group_size(batch_bytes):
    """Batches per gather: single batches from 256 KB up, else as many as fill about that.

    A gather is one crossing into Python; a group is split again inside
    tf.data, which copies each batch (wide batches would fault in fresh
    memory for that copy, so they go one by one, into the reused buffers).
    """
    return int(max(1, min(_MOST_GROUPED, _GROUP_BYTES // max(int(batch_bytes), 1))))


def _aligned(shape, dtype):
    """``(owner, array)``: an uninitialised C-contiguous array on a 64-byte boundary, and the
    array owning its memory (every NumPy view of it refers to that owner)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    owner = np.empty(nbytes + _ALIGN, np.uint8)
    skip = (-owner.ctypes.data) % _ALIGN
    return owner, owner[skip:skip + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Output arrays reused once nobody else refers to them; at most ``keep`` retained.

    An array handed to TensorFlow is referenced by the tensor that borrowed
    it until that tensor's memory is released. Reference counts tell when it
    is free again: the array's own (direct references, buffer exports) and
    its memory owner's (every NumPy view of it, however derived, refers to
    the owner). Arrays beyond ``keep`` are left to the garbage collector, so
    holding on to batches never makes the pool grow.
    """

    def __init__(self, keep):
        self.keep = int(keep)
        self._entries = []
        self._lock = threading.Lock()
        for owner, array in [_aligned((1,), np.uint8)]:     # referenced as in ``get``
            self._free = (sys.getrefcount(owner), sys.getrefcount(array))

    def get(self, shape, dtype):
        """A free array of ``shape`` and ``dtype`` (reused or new)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        with self._lock:
            for owner, array in self._entries:
                if (array.shape == shape and array.dtype == dtype
                        and (sys.getrefcount(owner), sys.getrefcount(array)) == self._free):
                    return array
            entry = _aligned(shape, dtype)
            if len(self._entries) < self.keep:
                self._entries.append(entry)
            return entry[1]

    def __len__(self):
        return len(self._entries)


def direct_view(table, names, spec):
    """The array to gather field ``names`` from as is, or None when it needs conversion.

    A single MappedColumn of a ColumnTable whose dtype is the output's,
    viewed with the output's per-sample shape.
    """
    if not isinstance(table, ColumnTable) or len(names) != 1:
        return None
    column = table.columns[names[0]]
    shape, dtype = spec
    if not isinstance(column, MappedColumn) or column.dtype != np.dtype(dtype):
        return None
    array = column.array
    try:
        return array.reshape((array.shape[0],) + tuple(shape))
    except ValueError:
        return None


class Gatherer:
    """Batch ``i`` of an epoch's plan for this rank, as arrays of the output dtypes."""

    def __init__(self, table, make, names, specs, keep, group):
        self._table, self._make, self.group = table, make, int(group)
        self._views = [direct_view(table, n, s) for n, s in zip(names, specs)]
        self._specs = specs
        self._pools = [BufferPool(keep) for _ in specs]
        self._plans = {}
        self._tokens = 0
        self._lock = threading.Lock()

    def begin(self, plan, rank):
        """Register ``plan``'s batches for ``rank``; returns the token the gathers name it by."""
        with self._lock:
            self._tokens += 1
            self._plans[self._tokens] = plan.groups(rank, self.group)
            for old in [t for t in self._plans if t <= self._tokens - _PLANS_KEPT]:
                del self._plans[old]
            return np.int64(self._tokens)

    def batch(self, key):
        """The arrays of the group ``key`` names: epoch token * 2**32 + group number.

        Shaped ``(batches, batch, ...)``, or ``(batch, ...)`` when groups are single batches.
        """
        token, index = divmod(int(key), _EPOCH_STRIDE)
        try:
            rows, count = self._plans[token][index]
        except KeyError:
            raise ReaderError("DataSet: an iterator of an earlier epoch was used after %d newer "
                              "ones started" % _PLANS_KEPT) from None
        with timeline.span("read", rows=len(rows)):
            return self._gather(rows, count)

    def _gather(self, rows, count):
        lead = (len(rows),) if self.group == 1 else (count, len(rows) // count)
        if any(view is None for view in self._views):
            order = np.argsort(rows, kind="stable")
            made = self._make(self._table.gather(rows[order]), order, count)
            made = made if isinstance(made, tuple) else (made,)
        out = []
        for k, (view, (shape, dtype), pool) in enumerate(zip(self._views, self._specs,
                                                            self._pools)):
            target = pool.get(lead + tuple(shape), dtype)
            if view is not None:
                np.take(view, rows, axis=0, out=target.reshape((len(rows),) + tuple(shape)))
            else:
                target[...] = made[k].reshape(target.shape)
            out.append(target)
        return tuple(out)


def tf_dataset(begin, gatherer, signature, groups, steps, parallel):
    """``steps`` batches: ``begin()`` (a new epoch's token) on each iteration, then gathers.

    The batches come in ``groups`` groups of up to ``gatherer.group`` batches.

    ``signature`` describes one batch (a TensorSpec or a tuple of them).
    Marked as sharded, of known length, like the generator path's dataset.
    """
    import tensorflow as tf

    specs = signature if isinstance(signature, tuple) else (signature,)
    dtypes = [s.dtype for s in specs]

    def start(_):
        return tf.numpy_function(begin, [], tf.int64, stateful=True)

    def keys(token):
        first = token * _EPOCH_STRIDE       # keys of the epoch's groups: no per-group map
        return tf.data.Dataset.range(first, first + groups)

    grouped = gatherer.group > 1

    def gather(key):
        values = tf.numpy_function(gatherer.batch, [key], dtypes, stateful=True)
        for value, spec in zip(values, specs):
            value.set_shape(([None] if grouped else []) + spec.shape.as_list())
        return values[0] if len(values) == 1 else tuple(values)

    def split(*group):
        return tf.data.Dataset.from_tensor_slices(group[0] if len(group) == 1 else group)

    # One stage per batch besides the gather (flat_map), and the length: each
    # further stage costs about as much per batch as the whole gather of a
    # narrow batch. The parallel map keeps ``parallel`` batches ahead.
    dataset = tf.data.Dataset.range(1).map(start).flat_map(keys)
    dataset = dataset.map(gather, num_parallel_calls=parallel, deterministic=True)
    if grouped:
        dataset = dataset.flat_map(split)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps))
    from matex import _batch_slicing

    return _batch_slicing.mark_sharded(dataset)
