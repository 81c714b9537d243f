"""netCDF files: the classic formats CDF-1, CDF-2 and CDF-5 (PnetCDF's), and netCDF-4.

Classic files are read without any netCDF library: the header is parsed
here and each variable's big-endian data is a view on a memory map of the
file (record variables at the record stride), so files written by netCDF
and by PnetCDF read alike, and each rank gathers its own samples without
collective calls (a PnetCDF binding is not needed). netCDF-4 files are
HDF5 files and are read as such.
"""

import os
import struct

import numpy as np

from ._errors import ReaderError
from ._mapped import MappedFile
from ._table import ColumnTable, as_names, check_lengths, select

_TYPES = {1: ">i1", 2: "S1", 3: ">i2", 4: ">i4", 5: ">f4", 6: ">f8",
          7: ">u1", 8: ">u2", 9: ">u4", 10: ">i8", 11: ">u8"}
_NUMERIC = {1, 3, 4, 5, 6, 7, 8, 9, 10, 11}
_DIMENSION, _VARIABLE, _ATTRIBUTE = 0x0A, 0x0B, 0x0C
_STREAMING = {0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF}


class _Header:
    """Sequential big-endian reader of a CDF header, fetching more of the file as needed."""

    def __init__(self, f, path):
        self.f, self.path = f, path
        self.buf, self.pos = b"", 0
        magic = self._take(4)
        if magic[:3] != b"CDF" or magic[3] not in (1, 2, 5):
            raise ReaderError("%s: not a netCDF classic file (magic %r)" % (path, magic))
        self.version = magic[3]
        self.big = self.version == 5       # 64-bit counts and sizes
        self.offset64 = self.version != 1  # 64-bit data offsets

    def _take(self, n):
        while len(self.buf) - self.pos < n:
            more = self.f.read(max(n, 1 << 16))
            if not more:
                raise ReaderError("%s: truncated netCDF header" % self.path)
            self.buf = self.buf[self.pos:] + more
            self.pos = 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self):
        return struct.unpack(">I", self._take(4))[0]

    def u64(self):
        return struct.unpack(">Q", self._take(8))[0]

    def count(self):
        """NON_NEG: 4 bytes, 8 in CDF-5."""
        return self.u64() if self.big else self.u32()

    def offset(self):
        return self.u64() if self.offset64 else self.u32()

    def name(self):
        n = self.count()
        raw = self._take(n)
        self._take(-n % 4)
        return raw.decode("utf-8", "replace")

    def list_header(self, tag):
        """Number of elements of a dim/att/var list (0 if absent)."""
        found = self.u32()
        n = self.count()
        if found not in (0, tag) or (found == 0 and n != 0):
            raise ReaderError("%s: corrupt netCDF header (list tag %#x)" % (self.path, found))
        return n

    def skip_attributes(self):
        for _ in range(self.list_header(_ATTRIBUTE)):
            self.name()
            nc_type = self.u32()
            n = self.count()
            if nc_type not in _TYPES:
                raise ReaderError("%s: corrupt netCDF header (type %d)" % (self.path, nc_type))
            size = n * np.dtype(_TYPES[nc_type]).itemsize
            self._take(size + (-size % 4))


def _parse(f, path):
    """(numrecs, dims [(name, length)], vars {name: (dimids, nc_type, begin)})."""
    h = _Header(f, path)
    numrecs = h.count()
    dims = [(h.name(), h.count()) for _ in range(h.list_header(_DIMENSION))]
    h.skip_attributes()
    variables = {}
    for _ in range(h.list_header(_VARIABLE)):
        name = h.name()
        dimids = [h.count() for _ in range(h.count())]
        h.skip_attributes()
        nc_type = h.u32()
        h.count()                      # vsize: recomputed, it saturates for large variables
        begin = h.offset()
        if nc_type not in _TYPES or any(d >= len(dims) for d in dimids):
            raise ReaderError("%s: corrupt netCDF header (variable %r)" % (path, name))
        variables[name] = (dimids, nc_type, begin)
    return numrecs, dims, variables


def _classic_table(path, features, labels):
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ReaderError("%s: no such file" % path) from None
    with f:
        numrecs, dims, variables = _parse(f, path)
        size = os.fstat(f.fileno()).st_size
    record_dim = next((i for i, (_, length) in enumerate(dims) if length == 0), None)

    def is_record(dimids):
        return bool(dimids) and dimids[0] == record_dim

    def record_bytes(dimids, nc_type):
        inner = [dims[d][1] for d in dimids[1:]]
        return int(np.prod(inner, dtype=np.int64)) * np.dtype(_TYPES[nc_type]).itemsize

    sizes = [record_bytes(d, t) for d, t, _ in variables.values() if is_record(d)]
    recsize = sizes[0] if len(sizes) == 1 else sum(n + (-n % 4) for n in sizes)
    if numrecs in _STREAMING:
        first = min((b for d, _, b in variables.values() if is_record(d)), default=size)
        numrecs = (size - first) // recsize if recsize else 0

    available = {name: nc_type in _NUMERIC and len(dimids) >= 1
                 for name, (dimids, nc_type, _) in variables.items()}
    xs, ys = select(available, features, labels, path, "variable",
                    _default_features(variables, dims, labels, record_dim))

    mapped, columns = MappedFile(path), {}
    for name in dict.fromkeys(xs + ys):
        dimids, nc_type, begin = variables[name]
        dtype = np.dtype(_TYPES[nc_type])
        inner = [dims[d][1] for d in dimids[1:]]
        row = int(np.prod(inner, dtype=np.int64)) * dtype.itemsize
        rows, step = (numrecs, recsize) if is_record(dimids) else (dims[dimids[0]][1], row)
        end = begin + (rows - 1) * step + row if rows else begin
        if end > size:
            mapped.close()
            raise ReaderError("%s: truncated: variable %r ends at byte %d but the file has %d"
                              % (path, name, end, size))
        strides, stride = [], dtype.itemsize
        for length in reversed(inner):
            strides.insert(0, stride)
            stride *= length
        columns[name] = mapped.column(begin, dtype, tuple([rows] + inner),
                                      tuple([step] + strides))
    check_lengths({n: c.num_rows for n, c in columns.items()}, path)
    return ColumnTable(path, columns, mapped=mapped), xs, ys


def _default_features(variables, dims, labels, record_dim):
    """Variables offered when ``features=None``: those along the sample dimension.

    The sample dimension is the first one of the (first) label variable, else
    the record dimension, else the first dimension of the first variable;
    coordinate variables (named after their dimension) are left out.
    """
    first = (as_names(labels) or [None])[0]
    if first in variables and variables[first][0]:
        sample = variables[first][0][0]
    elif record_dim is not None:
        sample = record_dim
    else:
        sample = next((v[0][0] for v in variables.values() if v[0]), None)
    return {name for name, (dimids, _, _) in variables.items()
            if dimids and dimids[0] == sample and dims[dimids[0]][0] != name}


def is_classic(path):
    """Whether ``path`` starts like a netCDF classic file (else it may be netCDF-4/HDF5)."""
    try:
        with open(path, "rb") as f:
            return f.read(3) == b"CDF"
    except FileNotFoundError:
        raise ReaderError("%s: no such file" % path) from None


def open_netcdf(paths, features, labels):
    """One table over the netCDF files ``paths``: ``(table, feature_names, label_names)``."""
    from ._hdf5 import open_hdf5
    from ._table import Concat

    tables = []
    try:
        for path in paths:
            if is_classic(path):
                table, xs, ys = _classic_table(path, features, labels)
            else:
                table, xs, ys, _ = open_hdf5([path], features, labels)
            tables.append(table)
        table = tables[0] if len(tables) == 1 else Concat(tables)
    except BaseException:
        for t in tables:
            t.close()
        raise
    return table, xs, ys
