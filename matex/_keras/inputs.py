"""``fit``/``evaluate`` inputs cut into this rank's share (policy: ``matex._batch_slicing``).

Arrays and ``PyDataset`` batches are shuffled here with permutations from a
seed shared by all ranks (Keras then gets ``shuffle=False``); ``tf.data``
datasets and generators are global batches every rank produces and slices.
"""

import inspect

import keras
import numpy as np
import tensorflow as tf

from matex import _runtime, _batch_slicing


def shared_seed():
    """A shuffling seed drawn from NumPy's global generator: rank 0's, on every rank.

    Every rank draws (generators that agree keep agreeing); rank 0's value
    is used everywhere, so a script seeded per rank still shuffles one way.
    A seeded script shuffles reproducibly; an unseeded one differently every
    run (transparent mode seeds NumPy from fresh entropy, see _transparent).
    """
    mine = int(np.random.randint(2 ** 31 - 1))
    return _runtime.control().bcast(mine, root=0)


def shuffles_itself(x):
    """Whether MaTEx, not Keras, shuffles ``fit``'s input ``x`` when ``shuffle=True``."""
    return _batch_slicing.is_array_input(x) or isinstance(x, keras.utils.PyDataset)


def present(*parts):
    return tuple(p for p in parts if p is not None)


def packed(x, y=None, sample_weight=None):
    """One element of in-memory data as Keras hands it to ``train_step``/``test_step``.

    ``x`` alone when there are no targets (``(x,)`` when ``x`` is itself a
    list or tuple of inputs), else ``(x, y)`` or ``(x, y, sample_weight)``
    (``keras.utils.pack_x_y_sample_weight``), with lists turned into tuples
    as Keras's array adapter does (``tf.data`` cannot hold a list of inputs).
    A model's own ``train_step(self, data)`` then gets what it gets in one
    process: a VAE reading ``data`` as its images gets the images.
    """
    return keras.tree.lists_to_tuples(keras.utils.pack_x_y_sample_weight(x, y, sample_weight))


def shard_input(x, y, sample_weight, batch_size, shuffle, seed, epoch=0):
    """(x, y, sample_weight, batch_size) to pass to Keras for this rank."""
    if x is None:
        return x, y, sample_weight, batch_size
    if isinstance(x, tf.data.Dataset):
        return _batch_slicing.shard(x), y, sample_weight, None
    if isinstance(x, keras.utils.PyDataset):
        if _batch_slicing.is_sharded(x):
            return x, y, sample_weight, None
        return _batch_slicing.shard_pydataset(x, shuffle, seed, epoch), y, sample_weight, None
    if inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        return _batch_slicing.shard_generator(x), y, sample_weight, None
    if _batch_slicing.is_array_input(x):
        shards = _batch_slicing.ArrayShards(packed(x, y, sample_weight), batch_size or 32, shuffle,
                                            seed)
        return shards.dataset(), None, None, None
    return x, y, sample_weight, batch_size


class EpochOfInput(keras.callbacks.Callback):
    """Tells ``fit``'s shuffled input which epoch Keras runs (resumed ones included).

    Keras starts at the epoch a ``BackupAndRestore`` restored (``matexrun
    --restart``), which is known only once training begins; the input's
    permutation must be that epoch's, as in an uninterrupted run. Arrays
    (``ArrayShards``) are told at the first ``on_epoch_begin`` only and count
    on from there: the next epoch's pass may have started (and counted
    itself) before that epoch begins. A ``PyDataset`` picks its batch order
    when a batch is asked for, and is told at every epoch.
    """

    def __init__(self, source, every_epoch=False):
        super().__init__()
        self.source = source
        self.every_epoch = every_epoch
        self.told = False

    def on_train_begin(self, logs=None):
        self.told = False

    def on_epoch_begin(self, epoch, logs=None):
        if self.every_epoch or not self.told:
            self.told = True
            self.source.set_epoch(epoch)


class TrainInput:
    """``fit``'s training input, re-creatable for the current ranks from any step."""

    def __init__(self, x, y, sample_weight, batch, shuffle, seed):
        self.raw = (x, y, sample_weight, batch, shuffle, seed)
        self.shards = None
        self.batches = None   # the sharded PyDataset of the last ``at``
        self.steps = None
        if _batch_slicing.is_array_input(x):
            self.shards = _batch_slicing.ArrayShards(packed(x, y, sample_weight), batch, shuffle,
                                                     seed)
            self.steps = self.shards.steps
        elif isinstance(x, tf.data.Dataset) and int(x.cardinality()) > 0:
            self.steps = int(x.cardinality())

    def callbacks(self):
        """Callbacks ``fit`` must pass to Keras with the input of ``at`` (``EpochOfInput``)."""
        if self.shards is not None:
            return [EpochOfInput(self.shards)]
        if self.batches is not None:
            return [EpochOfInput(self.batches, every_epoch=True)]
        return []

    def at(self, epoch, step):
        """(x, y, sample_weight, batch_size) for Keras, starting at (epoch, step).

        Pass ``callbacks()`` along: Keras may start at another epoch (a restored backup).
        """
        x, y, sw, batch, shuffle, seed = self.raw
        if self.shards is not None:
            return self.shards.dataset(epoch, step, fixed_comm=True), None, None, None
        if step and self.steps:
            x = x.skip(step)
        elif step:
            raise RuntimeError(
                "cannot resume training after a rank failure: fit's input is not re-iterable "
                "from a given step (use arrays or a tf.data dataset of known length)")
        given = shard_input(x, y, sw, batch, shuffle, seed, epoch)
        self.batches = given[0] if hasattr(given[0], "set_epoch") else None
        return given


def validation_input(validation, batch):
    """``fit``'s ``validation_data``, cut into this rank's share."""
    if isinstance(validation, (tuple, list)) and _batch_slicing.is_array_input(validation[0]):
        vx, vy, vsw = (tuple(validation) + (None, None))[:3]
        return shard_input(vx, vy, vsw, batch, False, 0)[0]
    return shard_input(validation, None, None, batch, False, 0)[0]
