"""Parallel readers for scientific files (HDF5, CSV, netCDF), sharded over ranks.

    from matex.readers import DataSet
    ds = DataSet("data/*.h5", features="x", labels="y", batch_size=64,
                 shuffle=True, seed=0, validation_split=0.1)   # 64 = the global batch
    model.fit(ds.train, validation_data=ds.validation, epochs=5)

``ds.train`` and ``ds.validation`` are tf.data.Datasets of ``(x, y)``
batches (``x`` alone when ``labels=None``) for THIS rank; every iteration
of ``ds.train`` is the next epoch. ``ds.steps_per_epoch`` is the same on
every rank, ``ds.num_samples`` counts the training part globally, and
``ds.training_data`` / ``ds.training_labels`` are this rank's unshuffled
shard as NumPy arrays (as in the original MaTEx).

Formats: HDF5 (named datasets, first axis = sample, or ``format=
"hdf5-classes"``: one top-level dataset per class), CSV (label column by
name or index, header detected or given; each rank parses only its byte
range), netCDF classic CDF-1/CDF-2/CDF-5 (as written by netCDF or PnetCDF;
first dimension = sample, fixed or unlimited) and netCDF-4.

CSV parsing: blocks of lines are parsed by a small native parser
(readers/_csvparse.cc, compiled on first use into the build directory, as
MaTEx's MPI core is) straight into float32, without holding the GIL, so the
reader's threads parse blocks in parallel. Numbers read as pandas' C parser
reads them (blanks around a field, "inf", True/False; an empty field is NaN);
"nan" or any other text in a selected column is an error naming its line and
column, as is a line with the wrong number of fields. Quoted fields may hold
delimiters, not line breaks. Without a C++ compiler, pandas parses the blocks
(slower; the reason is printed once).

Policies
--------
Batch size: ``batch_size`` is the GLOBAL batch, all ranks together, as in
Keras ``fit`` under MaTEx: each rank reads ``batch_size // size`` samples
per step, and a ``batch_size`` the number of ranks does not divide is a
ReaderError. ``per_rank_batch_size`` gives the batch of EACH rank instead
(global = that x size); neither means 32 per rank. In the original MaTEx
API ``batch_size`` was per rank: code written for it must now say
``per_rank_batch_size=`` (rank 0 prints a one-time note when
``batch_size`` is given on several ranks).

Remainder: every rank takes the same number of full batches,
``steps_per_epoch = num_samples // global batch``; the rest of the
epoch's order (less than one global batch) is dropped. With
shuffling the order changes each epoch, so different samples are dropped.
Validation is not shuffled: each rank gets ``n // size`` consecutive
samples (at most ``size - 1`` dropped) in batches whose last may be short;
validation steps are also equal on all ranks.

Shuffling: one permutation per epoch drawn from ``(seed, epoch)``, the same
on every rank, different each epoch; rank r reads the r-th contiguous
segment of it, a few batches at a time as one sorted bulk read. Data read
row by row (contiguous HDF5, netCDF classic) are permuted sample by
sample. Chunked or compressed HDF5 and CSV are read in whole units
(chunks, blocks of lines): the permutation shuffles the order of the units,
then shuffles samples within windows of consecutive units filling about
half the unit cache (the rank's whole share when every unit fits, which
then amounts to a sample-level shuffle of that share).
The trade-off: a unit is decoded once per epoch instead of once per
sample, at the price of batches that mix samples of only the units in one
window, so a larger ``memory_budget`` gives better mixing.

Memory: ``memory_budget`` (or MATEX_READER_MEMORY, e.g. ``"512M"``) bounds
what a rank's reader allocates: batches in flight, sample indices (8 bytes
per sample), decoding scratch, an eighth left for the allocator, and the
rest for caching decoded units (kept across epochs while they fit; CSV
blocks parsed when opening start out cached). Contiguous HDF5 and netCDF
classic data are read through memory maps, whose pages are the kernel's
page cache (reclaimable, as with any file read), not counted. Files larger
than the budget, or than memory, stream. Reads run ahead of training on a
thread pool sized to the CPUs the rank is bound to
(``os.sched_getaffinity``), and reach TensorFlow a group of batches at a
time.

Re-sharding: ``ds.reshard(consumed_steps)``, called on every rank after
``matex.comm()`` was replaced by a new communicator, re-divides the samples
of the current epoch not yet consumed (those of the first
``consumed_steps`` steps on every old rank are) among the new ranks, under
the same remainder policy and the same per-rank batch (the global batch
shrinks with the ranks), and returns the steps of that rest; the next
iteration of ``ds.train`` (take the property again: the datasets know their
length, which changed) yields the rest of the epoch, later ones whole
epochs for the new number of ranks.

Errors: bad input (missing file, field or column, different lengths,
truncated or corrupt files, non-numeric CSV fields, too few samples, files
whose shapes disagree) raises ``ReaderError`` (a ValueError) on every rank
with the same message.

Sharded marker: the tf.data.Datasets returned are marked as already
sharded in their ``tf.data.Options`` (``framework_type`` holds
``"matex.sharded"``; ``matex._batch_slicing.is_sharded``), a mark that
survives any later transformation (``.map``, ``.prefetch``, ``.cache``,
``.repeat``, ``.take``, ``.filter``, ``with_options``, ...): ``fit`` and
``matex.shard`` never slice them again.
"""

from ._dataset import DataSet
from ._errors import ReaderError

__all__ = ["DataSet", "ReaderError"]
