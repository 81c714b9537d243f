"""How training data is divided among ranks without changing its meaning.

Policy: the script's batch is the *global* batch. Each global batch of ``b``
rows is cut into ``size`` contiguous slices, rank ``r`` taking rows
``[r*b//size, (r+1)*b//size)``; slices differ by at most one row. Every rank
therefore runs exactly as many steps as there are global batches (no rank can
run out early and hang an allreduce), every sample is used once per epoch, and
the remainder (a final global batch smaller than the others, or a batch size
that does not divide by the number of ranks) is not dropped: gradients are
weighted by each rank's row count (``_optimizer``), so the update equals the
single-process update on the global batch. A rank whose slice is empty
contributes zero.

Inputs: NumPy arrays (and lists/dicts of them) are shuffled per epoch with one
permutation from ``(seed, epoch)`` shared by all ranks, and so is the batch
order of a ``keras.utils.PyDataset``; ``tf.data`` datasets, Python generators
and ``PyDataset`` batches are global batches that every rank produces and
slices (datasets from ``matex.readers`` are already sharded and pass through).
Any randomness in producing them must agree across ranks: transparent mode
seeds the script's generators alike on every rank (``_transparent``).
"""

import numpy as np
import tensorflow as tf

from matex import _runtime

SHARDED_ATTR = "_matex_sharded"


def slice_bounds(rows, rank, size):
    """Rows ``[lo, hi)`` of a global batch of ``rows`` rows that ``rank`` takes."""
    return rows * rank // size, rows * (rank + 1) // size


def _first_leaf(structure):
    return tf.nest.flatten(structure)[0]


def _rows(structure):
    leaf = _first_leaf(structure)
    return leaf.shape[0] if hasattr(leaf, "shape") else len(leaf)


class ArrayShards:
    """Per-rank batches of in-memory arrays, re-iterable (each pass = next epoch)."""

    def __init__(self, arrays, batch_size, shuffle, seed):
        self.arrays = tf.nest.map_structure(np.asarray, arrays)
        self.num_rows = _rows(self.arrays)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.first_step = 0
        self.steps = -(-self.num_rows // self.batch_size)

    def _batches(self):
        rank, size = _runtime.rank(), _runtime.size()
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        self.epoch += 1
        first, self.first_step = self.first_step, 0
        for start in range(first * self.batch_size, self.num_rows, self.batch_size):
            batch = order[start:start + self.batch_size]
            lo, hi = slice_bounds(len(batch), rank, size)
            rows = batch[lo:hi]
            yield tf.nest.map_structure(lambda a: a[rows], self.arrays)

    def dataset(self, epoch=0, first_step=0):
        """Batches from ``epoch`` on; the first pass starts at step ``first_step``.

        With ``first_step > 0`` the dataset is meant for that one (partial) epoch.
        """
        self.epoch, self.first_step = epoch, first_step
        spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)), self.arrays)
        ds = tf.data.Dataset.from_generator(self._batches, output_signature=spec)
        steps = self.steps - first_step
        ds = ds.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)
        setattr(ds, SHARDED_ATTR, True)
        return ds


def _slice_tensors(batch):
    rank, size = _runtime.rank(), _runtime.size()
    rows = tf.shape(_first_leaf(batch))[0]
    lo, hi = rows * rank // size, rows * (rank + 1) // size
    return tf.nest.map_structure(lambda t: t[lo:hi], batch)


def shard(dataset):
    """This rank's share of a batched ``tf.data.Dataset`` of global batches.

    Every rank must iterate the same dataset in the same order; each keeps its
    contiguous slice of every batch (see the module policy), so all ranks run
    the same number of steps. Already sharded datasets are returned unchanged.
    """
    if getattr(dataset, SHARDED_ATTR, False):
        return dataset
    sliced = dataset.map(lambda *batch: _slice_tensors(batch if len(batch) > 1 else batch[0]),
                         num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    setattr(sliced, SHARDED_ATTR, True)
    return sliced


def shard_generator(generator):
    """Slice each global batch a Python generator yields (every rank runs it)."""
    rank, size = _runtime.rank(), _runtime.size()
    for batch in generator:
        lo, hi = slice_bounds(_rows(batch), rank, size)
        yield tf.nest.map_structure(lambda a: a[lo:hi], batch)


def shard_pydataset(pydataset, shuffle=False, seed=0, epoch=0):
    """A ``keras.utils.PyDataset`` whose batches are this rank's slices.

    With ``shuffle`` the batch order is permuted per epoch, the permutation
    drawn from ``(seed, epoch)``: the same on every rank (Keras's own shuffle
    draws from each rank's ``random``, so ranks would take slices of
    different global batches). The epoch advances in ``on_epoch_end``, which
    Keras calls between epochs once no batch of the ending epoch is pending
    (and once before training: a shift that is the same on every rank).
    ``workers``, ``use_multiprocessing`` and ``max_queue_size`` are kept.
    """
    import keras

    batches = pydataset.num_batches

    class _Sharded(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=pydataset.workers,
                             use_multiprocessing=pydataset.use_multiprocessing,
                             max_queue_size=pydataset.max_queue_size)
            setattr(self, SHARDED_ATTR, True)
            self.epoch = epoch
            self.order = (None, None)   # (epoch, permutation)

        def __len__(self):
            return len(pydataset)

        @property
        def num_batches(self):
            return batches

        def _index(self, index):
            if not shuffle or batches is None or not 0 <= index < batches:
                return index
            epoch_now, order = self.order
            if epoch_now != self.epoch:
                epoch_now = self.epoch
                order = np.random.default_rng([seed, epoch_now]).permutation(batches)
                self.order = (epoch_now, order)
            return int(order[index])

        def __getitem__(self, index):
            batch = pydataset[self._index(index)]
            lo, hi = slice_bounds(_rows(batch), _runtime.rank(), _runtime.size())
            return tf.nest.map_structure(lambda a: a[lo:hi], batch)

        def on_epoch_begin(self):
            pydataset.on_epoch_begin()

        def on_epoch_end(self):
            self.epoch += 1
            pydataset.on_epoch_end()

    return _Sharded()


def is_array_input(x):
    """Whether ``x`` is in-memory array data (arrays or a list/dict of them)."""
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(
        isinstance(a, (np.ndarray, list)) or (hasattr(a, "__array__") and not isinstance(
            a, tf.data.Dataset)) for a in leaves)
