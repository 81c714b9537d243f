"""Batch slicing: each GLOBAL batch cut among the ranks, every row kept.

Policy: the script's batch is the *global* batch. Each global batch of ``b``
rows is cut into ``size`` contiguous slices, rank ``r`` taking rows
``[r*b//size, (r+1)*b//size)``; slices differ by at most one row. Every rank
therefore runs exactly as many steps as there are global batches (no rank can
run out early and hang an allreduce), every sample is used once per epoch, and
the remainder (a final global batch smaller than the others, or a batch size
that does not divide by the number of ranks) is not dropped: gradients are
weighted by each rank's row count (``_optimizer``), so the update equals the
single-process update on the global batch. A rank whose slice is empty
contributes zero. (``matex.readers`` divides differently: whole samples per
rank, remainder dropped; see ``readers/_partition.py``.)

Inputs: NumPy arrays (and lists/dicts of them) are shuffled per epoch with one
permutation from ``(seed, epoch)`` shared by all ranks, and so is the batch
order of a ``keras.utils.PyDataset``; ``tf.data`` datasets, Python generators
and ``PyDataset`` batches are global batches that every rank produces and
slices (datasets from ``matex.readers`` are already sharded and pass through).
Any randomness in producing them must agree across ranks: transparent mode
seeds the script's generators alike on every rank (``_transparent``).

Rank and size are read when a batch is sliced, not when the pipeline is
built: after the communicator is replaced (``_runtime._set_comm``, e.g. a
shrink after a rank failure) the same dataset or generator slices for the
new ranks. In ``tf.data`` this is the ``MatexCommInfo`` op (no Python per
batch).

"Already sharded" is recorded where it survives transformations: in the
dataset's ``tf.data.Options`` (see ``mark_sharded``), so ``matex.shard(ds)``
or a reader's dataset followed by ``.map``/``.prefetch``/``.cache``/
``.repeat``/``.take``/... is never sliced a second time by ``fit``.
"""

import threading
import warnings

import numpy as np
import tensorflow as tf

from matex import _runtime

SHARDED_ATTR = "_matex_sharded"     # marks a sharded keras.utils.PyDataset (an object, no options)
SHARDED_TAG = "matex.sharded"       # marks a sharded tf.data pipeline, in its options


def mark_sharded(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``dataset`` marked as already holding this rank's share (``fit`` leaves it alone).

    The mark is an entry in ``tf.data.Options.framework_type``: options live in
    the dataset graph and every transformation (map, filter, batch, cache,
    prefetch, repeat, take, skip, shuffle, zip, concatenate, with_options, ...)
    merges its inputs' options, appending to that list, so the mark survives
    them all and no later ``with_options`` can remove it. (A Python attribute
    is lost by the first transformation; ``auto_shard_policy`` is overwritten
    by any later ``with_options`` that sets a policy, and scripts set OFF for
    their own reasons.) ``auto_shard_policy`` is set to OFF as well, so that
    ``tf.distribute`` does not shard the share again either. Not seen through:
    a dataset built inside an ``interleave``/``flat_map`` function.
    """
    options = tf.data.Options()
    options.framework_type = [SHARDED_TAG]
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def is_sharded(x: object) -> bool:
    """Whether ``x`` already holds this rank's share: ``matex.shard``'s or a reader's output.

    True for a ``tf.data.Dataset`` any of whose inputs was marked by
    ``mark_sharded`` (whatever transformations followed), and for a
    ``keras.utils.PyDataset`` from ``shard_pydataset``.
    """
    if isinstance(x, tf.data.Dataset):
        with warnings.catch_warnings():     # graph mode: options as traced, which is enough here
            warnings.simplefilter("ignore")
            options = x.options()
        return SHARDED_TAG in (options.framework_type or ()) or bool(
            getattr(x, SHARDED_ATTR, False))
    return bool(getattr(x, SHARDED_ATTR, False))


def slice_bounds(rows, rank, size):
    """Rows ``[lo, hi)`` of a global batch of ``rows`` rows that ``rank`` takes."""
    return rows * rank // size, rows * (rank + 1) // size


def _first_leaf(structure):
    return tf.nest.flatten(structure)[0]


def _rows(structure):
    leaf = _first_leaf(structure)
    return leaf.shape[0] if hasattr(leaf, "shape") else len(leaf)


def _as_floatx(array):
    """``array`` as NumPy, floats other than Keras's floatx cast to it (as Keras's adapter).

    A float64 label array (``keras.utils.to_categorical``'s) otherwise flows
    into the step as float64: casts in the graph and twice the bytes per batch.
    """
    array = np.asarray(array)
    if array.dtype.kind == "f":
        import keras

        floatx = keras.config.floatx()
        if array.dtype != np.dtype(floatx):
            array = array.astype(floatx)
    return array


def _take_slice(batch):
    """This rank's rows of one global batch (NumPy or tensors), rank and size read now."""
    lo, hi = slice_bounds(_rows(batch), _runtime.rank(), _runtime.size())
    return tf.nest.map_structure(lambda a: a[lo:hi], batch)


TENSOR_COPY_BYTES = 256 << 20   # in-memory arrays up to this size are gathered as tensors


class ArrayShards:
    """Per-rank batches of in-memory arrays, re-iterable (each pass = next epoch).

    Pass ``e`` is shuffled with the permutation drawn from ``(seed, e)``. The
    first pass's epoch is set by ``dataset`` and, once Keras says which epoch
    it starts, by ``set_epoch`` (``fit``'s ``inputs.EpochOfInput``): after
    ``BackupAndRestore`` resumed at epoch ``k`` (``matexrun --restart``) the
    passes are ``k, k+1, ...``, the orders an uninterrupted run used for those
    epochs. Later passes count on from there, whenever they start (Keras opens
    the next epoch's iterator, and its prefetch runs, before that epoch begins).
    """

    def __init__(self, arrays, batch_size, shuffle, seed):
        self.arrays = tf.nest.map_structure(_as_floatx, arrays)
        self.num_rows = _rows(self.arrays)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._lock = threading.Lock()   # passes start in tf.data's threads
        self.epoch = 0                  # the epoch of the next pass to start
        self.start = (0, 0)             # (epoch, step) the dataset starts at
        self.steps = -(-self.num_rows // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The next pass to start is epoch ``epoch``'s (call before it starts)."""
        with self._lock:
            if self.epoch != epoch:
                self.start = (epoch, self.start[1] if epoch == self.start[0] else 0)
                self.epoch = epoch

    def order(self, epoch: int) -> np.ndarray:
        """The order of the rows in epoch ``epoch`` (the same on every rank)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return np.arange(self.num_rows)

    def _batch_rows(self):
        """This rank's row numbers in each batch of the next pass."""
        with self._lock:
            epoch = self.epoch
            self.epoch += 1
            first = self.start[1] if epoch == self.start[0] else 0
        order = self.order(epoch)
        for start in range(first * self.batch_size, self.num_rows, self.batch_size):
            yield _take_slice(order[start:start + self.batch_size])   # ranks read per batch

    def _pass_rows(self):
        """The next pass's row numbers at once, one row per batch (all batches full, the
        communicator fixed): no Python per batch."""
        yield np.array(list(self._batch_rows()), dtype=np.int64).reshape(
            -1, self._static_rows())

    def _batches(self):
        for rows in self._batch_rows():
            yield tf.nest.map_structure(lambda a: a[rows], self.arrays)

    def _tensors(self):
        """The arrays as tensors (made once), or None: above ``TENSOR_COPY_BYTES`` (the
        copy would double their memory), or where TensorFlow cannot hold them (object
        arrays). The batches are then gathered in tf.data's C++ threads, as Keras's own
        array adapter does, and only the row numbers pass through Python, once a pass:
        a small model's step then costs one plain Keras process's CPU (the batches read
        one by one in Python cost about 0.3 ms more each)."""
        if not hasattr(self, "_as_tensors"):
            self._as_tensors = None
            arrays = tf.nest.flatten(self.arrays)
            if sum(a.nbytes for a in arrays) <= TENSOR_COPY_BYTES:
                try:
                    self._as_tensors = tf.nest.map_structure(tf.convert_to_tensor, self.arrays)
                except (TypeError, ValueError):
                    pass
        return self._as_tensors

    def _static_rows(self):
        """This rank's rows in every batch when they never vary, else None.

        As Keras's own array adapter: a known batch dimension when every
        global batch is full. The step's graph is then smaller (an LSTM's
        backward loop: 77 ops per time step instead of 116, no shape
        arithmetic), so a small model's step costs less CPU. Only for a
        dataset used under the communicator it was made for (one ``fit``
        call); not under ULFM, where a shrink changes the slices of the
        batches still to come.
        """
        from matex import _resilience

        if self.num_rows % self.batch_size or _resilience.mode() == "ulfm":
            return None
        lo, hi = slice_bounds(self.batch_size, _runtime.rank(), _runtime.size())
        return hi - lo

    def dataset(self, epoch=0, first_step=0, fixed_comm=False):
        """Batches from ``epoch`` on; the pass of ``epoch`` starts at step ``first_step``.

        With ``first_step > 0`` the dataset is meant for that one (partial) epoch.
        ``fixed_comm``: the dataset is used only under today's communicator (a
        ``fit`` call makes its own), so its batch dimension may be static.
        """
        with self._lock:
            self.epoch, self.start = epoch, (epoch, first_step)
        rows = self._static_rows() if fixed_comm else None
        tensors = self._tensors() if rows is not None else None
        if tensors is not None:   # every batch's rows known when its pass starts
            ds = tf.data.Dataset.from_generator(
                self._pass_rows, output_signature=tf.TensorSpec((None, rows), tf.int64))
            ds = ds.unbatch().map(lambda taken: tf.nest.map_structure(
                lambda t: tf.gather(t, taken), tensors))
        else:
            spec = tf.nest.map_structure(
                lambda a: tf.TensorSpec((rows,) + a.shape[1:], tf.as_dtype(a.dtype)),
                self.arrays)
            ds = tf.data.Dataset.from_generator(self._batches, output_signature=spec)
        steps = self.steps - first_step
        ds = ds.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)
        return mark_sharded(ds)


def _slice_tensors(batch):
    """This rank's rows of a global batch inside tf.data.

    Rank and size come from the ``MatexCommInfo`` op, evaluated for every
    batch when the pipeline runs (a traced Python int would keep slicing for
    the communicator of the day the pipeline was built).
    """
    from matex import _collectives

    rank, size = _collectives.comm_info()
    rows = tf.shape(_first_leaf(batch))[0]
    lo, hi = rows * rank // size, rows * (rank + 1) // size
    return tf.nest.map_structure(lambda t: t[lo:hi], batch)


def shard(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """This rank's share of a batched ``tf.data.Dataset`` of global batches.

    Every rank must iterate the same dataset in the same order; each keeps its
    contiguous slice of every batch (see the module policy), so all ranks run
    the same number of steps. Datasets that already hold this rank's share
    (``is_sharded``: an earlier ``shard`` or a ``matex.readers`` dataset,
    followed by any transformations) are returned unchanged.
    """
    if is_sharded(dataset):
        return dataset
    sliced = dataset.map(lambda *batch: _slice_tensors(batch if len(batch) > 1 else batch[0]),
                         num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return mark_sharded(sliced)


def shard_generator(generator):
    """Slice each global batch a Python generator yields (every rank runs it).

    Rank and size are read per batch, so a generator spanning several epochs
    follows a replaced communicator.
    """
    for batch in generator:
        yield _take_slice(batch)


def shard_pydataset(pydataset, shuffle: bool = False, seed: int = 0, epoch: int = 0):
    """A ``keras.utils.PyDataset`` whose batches are this rank's slices.

    With ``shuffle`` the batch order is permuted per epoch, the permutation
    drawn from ``(seed, epoch)``: the same on every rank (Keras's own shuffle
    draws from each rank's ``random``, so ranks would take slices of
    different global batches). The epoch advances in ``on_epoch_end``, which
    Keras calls between epochs once no batch of the ending epoch is pending
    (and once before training: a shift that is the same on every rank).
    ``fit`` sets it to Keras's own epoch at every epoch's beginning
    (``set_epoch``, by ``inputs.EpochOfInput``), so that an epoch resumed from
    a restored backup is shuffled as in an uninterrupted run.
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
            return _take_slice(pydataset[self._index(index)])   # ranks read per batch

        def set_epoch(self, epoch):
            """Batches from now on are epoch ``epoch``'s (none of it fetched yet)."""
            self.epoch = epoch

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
