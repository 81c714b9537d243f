"""HDF5 files (h5py): named datasets, or the MaTEx layout of one dataset per class.

Contiguous uncompressed datasets are read through a memory map of the file
at the dataset's offset (gathers at memory speed); chunked or compressed
ones through h5py, whole chunks at a time.
"""

import os
import zlib

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
from h5py._objects import phil  # noqa: E402

from ._errors import ReaderError  # noqa: E402
from ._mapped import MappedFile  # noqa: E402
from ._table import (ColumnTable, Concat, ConstantColumn, as_names,  # noqa: E402
                            check_lengths, select)


class H5Column:
    """A chunked, compressed or otherwise h5py-only dataset, read in row ranges.

    Chunks spanning whole samples and filtered by deflate, shuffle and
    fletcher32 only are read raw and decoded here (zlib lets other threads
    run meanwhile, so several chunks decode at once); others go through h5py.
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.dtype, self.shape = dataset.dtype, dataset.shape[1:]
        self.num_rows = dataset.shape[0]
        self.unit_rows = dataset.chunks[0] if dataset.chunks else 1
        self._filters = self._raw_filters(dataset)
        self._chunk_bytes = int(np.prod(dataset.chunks or (1,))) * dataset.dtype.itemsize
        self.decode_bytes = 3 * self._chunk_bytes     # raw, inflated and unshuffled copies

    @staticmethod
    def _raw_filters(dataset):
        """The filter codes of the pipeline if its chunks can be decoded here, else None."""
        if not dataset.chunks or tuple(dataset.chunks[1:]) != tuple(dataset.shape[1:]):
            return None
        plist = dataset.id.get_create_plist()
        codes = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        usable = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32}
        return codes if set(codes) <= usable else None

    def gather(self, rows):
        return self.dataset[rows]

    def read_into(self, start, stop, out):
        if stop <= start:
            return
        if self._filters is None:
            self.dataset.read_direct(out, source_sel=np.s_[start:stop])
            return
        rows = self.unit_rows
        for first in range(start - start % rows, stop, rows):
            chunk = self._chunk(first)
            a, b = max(start, first), min(stop, first + rows)
            out[a - start:b - start] = chunk[a - first:b - first]

    def _chunk(self, first):
        """The decoded chunk whose first row is ``first`` (all its rows)."""
        offset = (first,) + (0,) * len(self.shape)
        try:
            with phil:      # h5py does not take its HDF5 lock for this call itself
                skipped, raw = self.dataset.id.read_direct_chunk(offset)
        except (RuntimeError, OSError):        # a chunk never written: fill values
            stop = min(first + self.unit_rows, self.num_rows)
            return self.dataset[first:stop]
        for index in reversed(range(len(self._filters))):
            if skipped & (1 << index):
                continue
            code = self._filters[index]
            if code == h5py.h5z.FILTER_FLETCHER32:
                raw = raw[:-4]
            elif code == h5py.h5z.FILTER_DEFLATE:
                raw = zlib.decompress(raw, bufsize=self._chunk_bytes)
            else:
                raw = _unshuffle(raw, self.dtype.itemsize)
        return np.frombuffer(raw, self.dtype).reshape((-1,) + tuple(self.shape))


def _unshuffle(raw, itemsize):
    """Undo HDF5's shuffle filter: byte planes back into items."""
    whole = len(raw) // itemsize * itemsize
    planes = np.frombuffer(raw, np.uint8, count=whole).reshape(itemsize, -1)
    return planes.T.tobytes() + raw[whole:]


def _numeric(obj):
    return (isinstance(obj, h5py.Dataset) and obj.dtype.fields is None
            and obj.dtype.kind in "biuf" and obj.ndim >= 1)


def _scale(obj):
    """Whether ``obj`` is a dimension scale (netCDF-4 coordinates): no default feature."""
    return obj.attrs.get("CLASS", b"") == b"DIMENSION_SCALE"


def _open(path):
    try:
        return h5py.File(path, "r", rdcc_nbytes=0)
    except FileNotFoundError:
        raise ReaderError("%s: no such file" % path) from None
    except OSError as exc:
        raise ReaderError("%s: cannot read as HDF5 (truncated or corrupt?): %s"
                          % (path, exc)) from None


def _column(dataset, mapped, path):
    """A MappedColumn when the data sit contiguous and raw in the file, else an H5Column."""
    if dataset.ndim == 0:
        raise ReaderError("%s: %r is a scalar, not samples" % (path, dataset.name))
    plist = dataset.id.get_create_plist()
    offset = dataset.id.get_offset()
    contiguous = (plist.get_layout() == h5py.h5d.CONTIGUOUS and plist.get_nfilters() == 0
                  and plist.get_external_count() == 0 and offset is not None)
    if not contiguous:
        return H5Column(dataset)
    end = offset + dataset.size * dataset.dtype.itemsize
    if end > mapped.size:
        raise ReaderError("%s: truncated: %r ends at byte %d but the file has %d bytes"
                          % (path, dataset.name, end, mapped.size))
    return mapped.column(offset, dataset.dtype, dataset.shape)


def _named_table(f, path, features, labels):
    available = {name: _numeric(obj) for name, obj in f.items()
                 if isinstance(obj, h5py.Dataset)}
    for name in (as_names(features) or []) + (as_names(labels) or []):
        if name not in available and isinstance(f.get(name), h5py.Dataset):
            available[name] = _numeric(f[name])
    xs, ys = select(available, features, labels, path, "dataset",
                    _default_features(f, available, labels))
    check_lengths({n: f[n].shape[0] for n in xs + ys}, path)
    mapped = MappedFile(path)
    columns = {n: _column(f[n], mapped, path) for n in dict.fromkeys(xs + ys)}
    return ColumnTable(path, columns, mapped=mapped, handle=f), xs, ys


def _default_features(f, available, labels):
    """Datasets offered when ``features=None``: numeric, not dimension scales, and as
    long as the (first) labels, or as the first such dataset when unlabeled."""
    candidates = [n for n, numeric in available.items() if numeric and not _scale(f[n])]
    first = (as_names(labels) or [None])[0]
    if first in available and available[first]:
        length = f[first].shape[0]
    elif candidates:
        length = f[candidates[0]].shape[0]
    else:
        return set()
    return {n for n in candidates if f[n].shape[0] == length}


def _class_names(f, features):
    if features is not None:
        names = list(features) if isinstance(features, (list, tuple)) else [features]
    else:
        names = [n for n, obj in f.items() if _numeric(obj) and not _scale(obj)]
        if all(n.isdigit() for n in names):
            names.sort(key=int)
        else:
            names.sort()
    return names


def _class_table(f, path, labels, names):
    """Each named top-level dataset is the samples of one class; the label is its index."""
    if not names:
        raise ReaderError("%s: no numeric top-level dataset to take as a class" % path)
    for name in names:
        if name not in f:
            raise ReaderError("%s: no dataset %r (class)" % (path, name))
        if not _numeric(f[name]):
            raise ReaderError("%s: dataset %r (class) is not numeric" % (path, name))
    shapes = {n: f[n].shape[1:] for n in names}
    if len(set(shapes.values())) > 1:
        detail = ", ".join("%r: %s" % (n, s) for n, s in shapes.items())
        raise ReaderError("%s: classes have different sample shapes: %s" % (path, detail))
    mapped = MappedFile(path)
    members = []
    for index, name in enumerate(names):
        columns = {"data": _column(f[name], mapped, path)}
        if labels is not None:
            columns["class"] = ConstantColumn(index, f[name].shape[0])
        members.append(ColumnTable(path, columns, mapped=mapped if index == 0 else None,
                                   handle=f if index == 0 else None))
    xs, ys = ["data"], (["class"] if labels is not None else [])
    return Concat(members, stratified=True), xs, ys


def open_hdf5(paths, features, labels, classes=False):
    """One table over the HDF5 files ``paths``.

    Returns ``(table, feature_names, label_names, class_names)``.
    """
    tables, class_names = [], None
    try:
        for path in paths:
            f = _open(path)
            try:
                if classes:
                    names = _class_names(f, features)
                    if class_names is None:
                        class_names = names
                    elif names != class_names:
                        raise ReaderError("%s and %s have different classes: %s vs %s"
                                          % (paths[0], path, class_names, names))
                    table, xs, ys = _class_table(f, path, labels, names)
                else:
                    table, xs, ys = _named_table(f, path, features, labels)
            except BaseException:
                f.close()
                raise
            tables.append(table)
        table = tables[0] if len(tables) == 1 else Concat(tables, stratified=classes)
    except BaseException:
        for t in tables:
            t.close()
        raise
    return table, xs, ys, class_names
