"""DataSet: files of samples, sharded over the ranks of ``matex.comm()``, as tf.data batches."""

from __future__ import annotations

import glob
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np

import matex
from matex import _config, _runtime, _state, timeline

from . import _gather, _partition
from ._errors import ReaderError, agreed
from ._pipeline import cpu_count, stream, tf_dataset
from ._reader import Reader, row_bytes

if TYPE_CHECKING:
    import tensorflow as tf

FORMATS = ("hdf5", "hdf5-classes", "csv", "netcdf")
_EXTENSIONS = {".h5": "hdf5", ".hdf5": "hdf5", ".he5": "hdf5", ".csv": "csv",
               ".nc": "netcdf", ".nc4": "netcdf", ".cdf": "netcdf"}
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MIN_SLOTS = 8              # fewest units the cache must hold
_GROUP_BYTES = 1 << 20      # batches go to TensorFlow in groups of about this size
_MOST_GROUPED = 64
_SLACK = 8                  # 1/8 of the budget is left for what the allocator holds on to
_DEFAULT_PER_RANK = 32      # batch of each rank when no batch size is given
# noted: the one-time note on batch_size's meaning was printed
_now = _state.namespace("readers.dataset", noted=False)


def budget_bytes(value=None):
    """Bytes a DataSet may use per rank: ``value``, else MATEX_READER_MEMORY, else a default.

    Accepts an int or a string such as ``"512M"`` or ``"2G"``. The default
    is a quarter of physical memory shared by the ranks of the node, at most
    4 GiB.
    """
    if value is None:
        value = _config.reader_memory()
    if value is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(min(total // 4 // max(matex.local_size(), 1), 4 << 30))
    if isinstance(value, str):
        text = value.strip().lower().rstrip("ib").rstrip("b")
        scale = _UNITS.get(text[-1:], 1)
        try:
            value = float(text[:-1] if text[-1:] in _UNITS else text) * scale
        except ValueError:
            raise ReaderError("memory budget %r is not a size (e.g. 512M, 2G)" % value) from None
    if value <= 0:
        raise ReaderError("memory budget must be positive, got %r" % value)
    return int(value)


def resolve(source, fmt):
    """``(format, paths)`` for a path, a list of paths, a directory or a glob."""
    if fmt is not None and fmt not in FORMATS:
        raise ReaderError("unknown format %r (one of %s)" % (fmt, ", ".join(FORMATS)))
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    if not items:
        raise ReaderError("no source given")
    paths = []
    for item in map(os.fspath, items):
        if os.path.isdir(item):
            found = sorted(os.path.join(item, n) for n in os.listdir(item)
                           if os.path.splitext(n)[1].lower() in _EXTENSIONS
                           and os.path.isfile(os.path.join(item, n)))
            if not found:
                raise ReaderError("%s: directory holds no %s file"
                                  % (item, "/".join(sorted(_EXTENSIONS))))
            paths += found
        elif glob.has_magic(item):
            found = sorted(glob.glob(item))
            if not found:
                raise ReaderError("%s: no file matches" % item)
            paths += found
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise ReaderError("%s: no such file" % item)
    if fmt is None:
        kinds = {_EXTENSIONS.get(os.path.splitext(p)[1].lower()) for p in paths}
        if None in kinds:
            bad = next(p for p in paths if _EXTENSIONS.get(os.path.splitext(p)[1].lower()) is None)
            raise ReaderError("%s: cannot tell the format from the extension; pass format="
                              "(one of %s)" % (bad, ", ".join(FORMATS)))
        if len(kinds) > 1:
            raise ReaderError("files of different formats in one data set: %s" % sorted(kinds))
        fmt = kinds.pop()
    return fmt, paths


class DataSet:
    """Samples from HDF5, CSV or netCDF files, sharded over ``matex.comm()``'s ranks.

    ``DataSet(source, features="x", labels="y", format=None, batch_size=None,
    shuffle=True, seed=0, validation_split=0.0, memory_budget=None,
    header=None, delimiter=",", per_rank_batch_size=None)``

    - ``source``: a path, a list of paths, a directory or a glob; several
      files are one data set, in sorted (or given) order.
    - ``format``: ``"hdf5"``, ``"hdf5-classes"``, ``"csv"`` or ``"netcdf"``;
      inferred from the extension when None (``"hdf5"`` for .h5/.hdf5).
      ``"hdf5-classes"`` is the MaTEx layout: each top-level dataset holds
      the samples of one class; ``features`` lists the class datasets (None:
      all, in numeric or else alphabetical order, see ``class_names``) and
      any ``labels`` but None yields the class index as the label.
    - ``features``: a field name (HDF5 dataset, netCDF variable, CSV column
      name or index), a list of them, or None for every numeric field but
      the labels (HDF5: datasets as long as the labels, netCDF: variables
      along the labels' first dimension, coordinate variables and dimension
      scales excepted; CSV: columns numeric in the first data row). One
      field keeps its per-sample shape (scalars become ``(1,)``); several
      are flattened and concatenated. Always float32.
    - ``labels``: a field, a list (concatenated as float32) or None for
      unlabeled data (batches are then ``x`` alone). Integer labels are
      int64, others float32 (CSV labels are float32).
    - ``batch_size``: the GLOBAL batch, all ranks together, as ``batch_size``
      means in Keras ``fit`` under MaTEx; each rank reads ``batch_size //
      matex.size()`` samples per step. It must divide by the number of ranks
      (else a ReaderError naming both numbers). ``per_rank_batch_size``: the
      batch of EACH rank instead (the global batch is then that times
      ``matex.size()``). Give at most one; neither means 32 per rank.
      CHANGED from the original MaTEx API, where ``batch_size`` was per
      rank: such code now reads 1/size of the batch it meant; write
      ``per_rank_batch_size=`` to keep the old meaning (rank 0 prints a
      one-time note when ``batch_size`` is given on several ranks). The
      attributes ``batch_size`` (global, at the current number of ranks)
      and ``per_rank_batch_size`` hold both values.
    - ``shuffle``/``seed``: one order per epoch drawn from ``(seed, epoch)``,
      the same on every rank. ``validation_split``: the last fraction of the
      samples (of each class with ``"hdf5-classes"``) is the validation part.
    - ``memory_budget``: bytes this rank's reader may use (int or "512M";
      default MATEX_READER_MEMORY or a quarter of the node's memory per rank,
      at most 4 GiB). Files larger than it are streamed.
    - ``header``/``delimiter``: CSV only; ``header=None`` detects a header
      line (a first line with a non-numeric field).

    Every iteration of ``train`` is one epoch; ``validation`` is not
    shuffled. Bad input raises ReaderError on every rank.
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike],
                 features: str | int | Sequence[str | int] | None = "x",
                 labels: str | int | Sequence[str | int] | None = "y",
                 format: str | None = None,  # noqa: A002 - the keyword of the original MaTEx API
                 batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, validation_split: float = 0.0,
                 memory_budget: int | str | None = None,
                 header: bool | None = None, delimiter: str = ",",
                 per_rank_batch_size: int | None = None) -> None:
        if not 0.0 <= validation_split < 1.0:
            raise ReaderError("validation_split must be in [0, 1), got %r" % (validation_split,))
        self.per_rank_batch_size = _per_rank_batch(batch_size, per_rank_batch_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.memory_budget = _runtime.control().allreduce(agreed(budget_bytes, memory_budget),
                                                    op=_mpi_min())
        self._lock = threading.Lock()
        self._epoch, self._current, self._resume = 0, None, None
        self._train_tf, self._validation_tf = {}, {}     # by length
        self._shards = {}
        self._threads = cpu_count()
        self._depth = self._threads + 2
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="matex-reader")
        self._table, self._parsed = None, {}
        try:
            self.format, self.paths = agreed(resolve, source, format)
            self.class_names = None
            self._table, self._x, self._y = self._open(features, labels, header, delimiter,
                                                       self.memory_budget)
            self._setup(validation_split, self.memory_budget)
        except BaseException:
            self.close()
            raise

    # -- opening -------------------------------------------------------------

    def _open(self, features, labels, header, delimiter, budget):
        if self.format == "csv":
            return self._open_csv(features, labels, header, delimiter, budget)
        if self.format == "netcdf":
            from ._netcdf import open_netcdf

            return agreed(open_netcdf, self.paths, features, labels,
                          discard=lambda r: r[0].close())
        from ._hdf5 import open_hdf5

        table, xs, ys, self.class_names = agreed(
            open_hdf5, self.paths, features, labels, self.format == "hdf5-classes",
            discard=lambda r: r[0].close())
        return table, xs, ys

    def _open_csv(self, features, labels, header, delimiter, budget):
        from ._csv import CsvTable, Layout, merge, scan

        comm = _runtime.control()   # MaTEx's own messages, apart from data collectives
        layout = agreed(Layout, self.paths, features, labels, header, delimiter)
        block = int(min(4 << 20, max(64 << 10, budget // 128)))
        blocks, error, parsed = agreed(scan, layout, comm.Get_rank(), comm.Get_size(), block,
                                       budget // 4)
        blocks = merge(layout, comm.allgather((blocks, error)))
        table = agreed(CsvTable, layout, blocks, discard=lambda t: t.close())
        self._parsed = {table.unit_of(*key): values for key, values in parsed.items()}
        return table, ["x"], (["y"] if "y" in table.fields else [])

    def _setup(self, validation_split, budget):
        """Split off the validation part, check there is enough data, plan the memory."""
        table, size = self._table, matex.size()
        train, validation = _partition.split_validation(table.groups, validation_split)
        self._train_pieces = _partition.pieces(train, table.unit_starts)
        self._validation_pieces = _partition.pieces(validation)
        self.num_samples = int((train[:, 1] - train[:, 0]).sum())
        self.num_validation_samples = int((validation[:, 1] - validation[:, 0]).sum())
        if self.num_samples < self.per_rank_batch_size * size:
            raise ReaderError("%s: %d training samples are fewer than one global batch, ranks x "
                              "per-rank batch = %d x %d"
                              % (table.path, self.num_samples, size, self.per_rank_batch_size))
        if validation_split and self.num_validation_samples < size:
            raise ReaderError("%s: %d validation samples are fewer than the %d ranks"
                              % (table.path, self.num_validation_samples, size))
        self._x_spec, self._y_spec = self._specs()
        self._plan_memory(budget)

    def _plan_memory(self, budget):
        """Share ``budget`` among batches in flight, indices, decoding and cached units."""
        table = self._table
        raw = row_bytes(table.fields)
        out = 4 * int(np.prod(self._x_spec[0])) + (8 * int(np.prod(self._y_spec[0]))
                                                   if self._y_spec else 0)
        per_rank = self.per_rank_batch_size
        batch = per_rank * (raw + out)
        self._group = int(max(1, min(_MOST_GROUPED, min(_GROUP_BYTES, budget // 64) // batch)))
        in_flight = (self._depth + 2) * 2 * self._group * batch + 2 * per_rank * out
        index = 2 * np.dtype(_partition.index_dtype(table.num_rows)).itemsize * table.num_rows
        scratch = self._threads * table.decode_bytes
        capacity = budget - budget // _SLACK - in_flight - index - scratch
        least = 0
        if table.unit_starts is not None:
            lengths = np.diff(np.append(table.unit_starts, table.num_rows))
            least = int(lengths.max()) * raw * _MIN_SLOTS
        if capacity < least:
            raise ReaderError(
                "memory budget of %d bytes is too small for %s: batches in flight take %d, "
                "sample indices %d, decoding %d, and cached units at least %d"
                % (budget, table.path, in_flight, index, scratch, least))
        self._reader = Reader(table, capacity, self._pool.submit)
        while self._parsed:                             # CSV blocks parsed when opening
            unit, values = self._parsed.popitem()
            if not self._reader.preload(unit, lambda out: table.fill(values, out)):
                self._parsed = {}
        self._window = None
        if not self._reader.by_row:
            if self._reader.slots >= len(table.unit_starts):
                self._window = table.num_rows
            else:
                units = max(1, self._reader.slots // 2 - 3)
                self._window = units * self._reader.typical_unit_rows()
            if self._window < self.per_rank_batch_size:
                raise ReaderError(
                    "memory budget of %d bytes is too small for %s: the units it can hold "
                    "give shuffle windows of %d samples, less than the per-rank batch %d"
                    % (budget, table.path, self._window, self.per_rank_batch_size))
            self._group = min(self._group, self._window // self.per_rank_batch_size)
        self._gatherer = None
        if self._reader.by_row:
            specs = (self._x_spec,) + ((self._y_spec,) if self._y_spec else ())
            names = (self._x,) + ((self._y,) if self._y_spec else ())
            self._gatherer = _gather.Gatherer(table, self._make, names, specs,
                                              keep=self._parallel() + 6,
                                              group=_gather.group_size(out * per_rank))

    def _specs(self):
        """((x sample shape, dtype), (y sample shape, dtype) or None)."""
        fields = self._table.fields
        if len(self._x) == 1:
            shape = tuple(fields[self._x[0]][1]) or (1,)
        else:
            shape = (sum(int(np.prod(fields[n][1], dtype=np.int64)) for n in self._x),)
        y = None
        if self._y:
            if len(self._y) == 1:
                dtype, yshape = fields[self._y[0]]
                y = (tuple(yshape), np.int64 if np.dtype(dtype).kind in "biu" else np.float32)
            else:
                y = ((sum(int(np.prod(fields[n][1], dtype=np.int64)) for n in self._y),),
                     np.float32)
        return (shape, np.float32), y

    # -- batches -------------------------------------------------------------

    @staticmethod
    def _stack(fields, names, spec, inverse, count):
        """``count`` batches of ``names`` as one array, rows taken in ``inverse`` order."""
        shape, dtype = spec
        rows = len(inverse)
        if len(names) == 1:
            values = fields[names[0]].reshape((rows,) + shape)
        else:
            values = np.concatenate([fields[n].reshape(rows, -1) for n in names], axis=1)
        out = np.take(values, inverse, axis=0).astype(dtype, copy=False)
        return out.reshape((count, rows // count) + shape)

    def _make(self, fields, order, count):
        """The group of ``count`` batches from its rows read in sorted order (see stream)."""
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order), dtype=order.dtype)
        x = self._stack(fields, self._x, self._x_spec, inverse, count)
        if self._y_spec is None:
            return x
        return x, self._stack(fields, self._y, self._y_spec, inverse, count)

    def _batches(self, plan):
        """This rank's batches of ``plan``, in groups of up to ``self._group`` batches."""
        return stream(self._reader, plan.groups(matex.rank(), self._group), self._make,
                      self._pool.submit, self._depth)

    def _train_plan(self, epoch):
        with timeline.span("shuffle", epoch=int(epoch)):
            order = _partition.epoch_order(*self._train_pieces, self.seed, epoch, self.shuffle,
                                          self._reader.by_row)
            return _partition.EpochPlan(order, matex.size(), self.per_rank_batch_size,
                                       window=self._window if self.shuffle else None,
                                       key=(self.seed, epoch))

    def _validation_plan(self):
        return _partition.EpochPlan(_partition.rows_of(*self._validation_pieces), matex.size(),
                                   self.per_rank_batch_size, drop_remainder=False)

    def _train_epoch(self):
        with self._lock:
            if self._resume is not None:
                plan, self._resume = self._resume, None
            else:
                self._current = None            # its indices are not needed any more
                plan = self._train_plan(self._epoch)
                self._epoch += 1
            self._current = plan
        yield from self._batches(plan)

    def _begin_train(self):
        """A new epoch (or the resumed rest of one) for the gathers; its token."""
        with self._lock:
            if self._resume is not None:
                plan, self._resume = self._resume, None
            else:
                self._current = None
                plan = self._train_plan(self._epoch)
                self._epoch += 1
            self._current = plan
        return self._gatherer.begin(plan, matex.rank())

    def _begin_validation(self):
        return self._gatherer.begin(self._validation_plan(), matex.rank())

    def _parallel(self):
        """Batches gathered at once: one per CPU, at least two (one waits on page faults)."""
        return max(2, min(self._threads, 8))

    def _dataset(self, generator, begin, steps, groups=None):
        """The generator path's dataset, or the gathers' for tables read row by row.

        ``groups``: how many groups the gathers' plan has (default: full batches only).
        """
        if self._gatherer is None:
            return tf_dataset(generator, self._signature(), steps)
        if groups is None:
            groups = -(-steps // self._gatherer.group)
        return _gather.tf_dataset(begin, self._gatherer, self._signature(), groups, steps,
                                  self._parallel())

    def _validation_epoch(self):
        yield from self._batches(self._validation_plan())

    def _signature(self):
        import tensorflow as tf

        x = tf.TensorSpec((None,) + self._x_spec[0], tf.float32)
        if self._y_spec is None:
            return x
        return x, tf.TensorSpec((None,) + self._y_spec[0], tf.as_dtype(self._y_spec[1]))

    @property
    def train(self) -> tf.data.Dataset:
        """tf.data.Dataset of this rank's training batches; each iteration is the next epoch.

        Its length is that of the next iteration: after ``reshard``, or when
        ``matex.comm()`` changed size, take ``ds.train`` again.
        """
        steps = self._resume.steps if self._resume is not None else self.steps_per_epoch
        if steps not in self._train_tf:
            self._train_tf[steps] = self._dataset(self._train_epoch, self._begin_train, steps)
        return self._train_tf[steps]

    @property
    def validation(self) -> tf.data.Dataset | None:
        """tf.data.Dataset of this rank's validation batches (in file order), or None."""
        if not self.num_validation_samples:
            return None
        steps = self.validation_steps
        if steps not in self._validation_tf:
            groups = None
            if self._gatherer is not None:
                groups = len(self._validation_plan().groups(matex.rank(), self._gatherer.group))
            self._validation_tf[steps] = self._dataset(self._validation_epoch,
                                                       self._begin_validation, steps, groups)
        return self._validation_tf[steps]

    @property
    def batch_size(self) -> int:
        """The global batch: ``per_rank_batch_size`` times the current number of ranks.

        After the communicator shrank (see ``reshard``) the per-rank batch is
        kept, so the global batch shrinks with the ranks.
        """
        return self.per_rank_batch_size * matex.size()

    @property
    def steps_per_epoch(self) -> int:
        """Training steps (batches) per epoch, the same on every rank."""
        return self.num_samples // (self.per_rank_batch_size * matex.size())

    @property
    def validation_steps(self) -> int:
        """Validation batches per pass, the same on every rank (the last may be short)."""
        return -(-(self.num_validation_samples // matex.size()) // self.per_rank_batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration of ``train`` starts (settable, e.g. when resuming)."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        with self._lock:
            self._epoch, self._resume = int(value), None

    # -- MaTEx-compatible arrays -----------------------------------------------

    def _shard(self, part):
        key = (part, matex.rank(), matex.size())
        if key not in self._shards:
            if part == "train":
                plan = _partition.EpochPlan(_partition.rows_of(*self._train_pieces), matex.size(),
                                            self.per_rank_batch_size)
            else:
                plan = self._validation_plan()
            groups = list(self._batches(plan))
            flat = lambda group: group.reshape((-1,) + group.shape[2:])  # noqa: E731
            if self._y_spec is None:
                self._shards[key] = (np.concatenate([flat(g) for g in groups]), None)
            else:
                self._shards[key] = (np.concatenate([flat(g[0]) for g in groups]),
                                     np.concatenate([flat(g[1]) for g in groups]))
        return self._shards[key]

    @property
    def training_data(self) -> np.ndarray:
        """This rank's training samples (its unshuffled shard) as one NumPy array."""
        return self._shard("train")[0]

    @property
    def training_labels(self) -> np.ndarray | None:
        """Labels of ``training_data`` (None for unlabeled data)."""
        return self._shard("train")[1]

    @property
    def validation_data(self) -> np.ndarray:
        """This rank's validation samples as one NumPy array."""
        return self._shard("validation")[0]

    @property
    def validation_labels(self) -> np.ndarray | None:
        """Labels of ``validation_data`` (None for unlabeled data)."""
        return self._shard("validation")[1]

    # -- re-sharding -----------------------------------------------------------

    def reshard(self, consumed_steps: int) -> int:
        """Re-divide the rest of the current epoch among the ranks of the current ``matex.comm()``.

        Call it on every rank of the new communicator (a collective), with the
        number of training steps every rank of the old one completed in the
        current epoch (counted from its last (re)start). The samples those
        steps read stay consumed; the others (including the ones the old plan
        left out as its remainder) are divided afresh, so none is read twice
        and at most one global batch less one sample are left out. The
        per-rank batch is kept: the global batch shrinks with the ranks.
        The next iteration of ``train`` (take ``ds.train`` anew) yields the
        rest of the epoch; later ones are whole epochs again. Returns the
        number of steps of that rest.
        """
        comm = _runtime.control()   # MaTEx's own messages, apart from data collectives
        steps = int(consumed_steps)
        reported = comm.allgather(steps)
        if len(set(reported)) > 1:
            raise ReaderError("reshard: ranks disagree on consumed_steps: %s" % reported)
        with self._lock:
            current = self._current
            if current is None:
                if steps:
                    raise ReaderError("reshard: no epoch has started, consumed_steps must be 0")
                return self.steps_per_epoch
            if not 0 <= steps <= current.steps:
                raise ReaderError("reshard: consumed_steps=%d but the epoch had %d steps"
                                  % (steps, current.steps))
            plan = _partition.EpochPlan(current.remaining(steps), comm.Get_size(),
                                        self.per_rank_batch_size)
            self._current = plan
            self._resume = plan if plan.steps else None
            return plan.steps

    def close(self) -> None:
        """Release files and threads."""
        self._pool.shutdown(wait=True)
        if self._table is not None:
            self._table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _per_rank_batch(batch_size, per_rank_batch_size):
    """The per-rank batch from DataSet's arguments; a ReaderError on every rank if they are bad.

    Collective: the ranks also check that they agree on it (ranks reading
    batches of different sizes would run different numbers of steps).
    """
    size, error, per_rank = matex.size(), None, None
    try:
        per_rank = _check_batch(batch_size, per_rank_batch_size, size)
    except ReaderError as exc:
        error = str(exc)
    everyone = _runtime.control().allgather((error, per_rank))
    first = next((e for e, _ in everyone if e is not None), None)
    if first is not None:
        raise ReaderError(first)
    if len({p for _, p in everyone}) > 1:
        raise ReaderError("ranks disagree on the per-rank batch: %s (give every rank the same "
                          "batch_size)" % [p for _, p in everyone])
    if batch_size is not None and size > 1 and not _now.noted and matex.rank() == 0:
        _now.noted = True
        print("matex.readers: DataSet(batch_size=%d) is the GLOBAL batch: %d samples per rank "
              "on %d ranks. In the original MaTEx API batch_size was per rank; for that "
              "meaning write per_rank_batch_size=%d." % (batch_size, per_rank, size, batch_size),
              file=sys.stderr, flush=True)
    return per_rank


def _check_batch(batch_size, per_rank_batch_size, size):
    """The per-rank batch (no communication); ReaderError on bad arguments."""
    if batch_size is not None and per_rank_batch_size is not None:
        raise ReaderError("give batch_size (the global batch) or per_rank_batch_size, not both "
                          "(got %r and %r)" % (batch_size, per_rank_batch_size))
    for name, value in (("batch_size", batch_size), ("per_rank_batch_size", per_rank_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, (int, np.integer)) or value < 1):
            raise ReaderError("%s must be a positive integer, got %r" % (name, value))
    if per_rank_batch_size is not None:
        return int(per_rank_batch_size)
    if batch_size is None:
        return _DEFAULT_PER_RANK
    if batch_size % size:
        raise ReaderError(
            "batch_size=%d is the GLOBAL batch (all ranks together) and does not divide among "
            "%d ranks: give a multiple of %d, or per_rank_batch_size= for the batch of each "
            "rank (what batch_size meant in the original MaTEx API)" % (batch_size, size, size))
    return int(batch_size) // size


def _mpi_min():
    from mpi4py import MPI

    return MPI.MIN
