"""CSV files: cut into byte ranges on line boundaries, parsed by a native parser.

Each rank parses only its own byte range when the data set is opened (to
count rows and check every field), in blocks of whole lines; the blocks
are the units later reads decode, and those parsed when opening start out
cached. Fields are separated by ``delimiter``; quoted fields must not
contain line breaks. Empty fields read as NaN.

Blocks are parsed by ``_matex_csvparse`` (readers/_csvparse.cc, compiled on
first use, see matex/_build.py), which reads numbers as pandas' C parser
does, straight into float32, without the GIL. pandas parses the blocks the
native parser does not take (a quote left open at a line end, a delimiter
that is not one byte) and every block when the native parser cannot be
built (the reason is printed once).
"""

import contextlib
import importlib.util
import io
import os
import sys
import sysconfig
import threading

import numpy as np

from matex import _state

from ._errors import ReaderError
from ._table import Table, as_names


def _number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def _split(line, delimiter):
    return [f.strip().strip('"').strip() for f in line.rstrip("\r\n").split(delimiter)]


def _head(path, limit=1 << 20):
    """The first two lines of ``path`` as text, and the length in bytes of the first."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit)
    except FileNotFoundError:
        raise ReaderError("%s: no such file" % path) from None
    first = raw.find(b"\n") + 1 or len(raw)
    return raw.decode("utf-8", "replace").splitlines(keepends=True)[:2], first


class Layout:
    """The columns of a CSV data set and which of them are read, as every rank sees them."""

    def __init__(self, paths, features, labels, header, delimiter):
        self.paths, self.delimiter = list(paths), delimiter
        self.sizes = [os.path.getsize(p) for p in paths]
        self.starts = []
        names = None
        first_data = None
        for path in self.paths:
            head, first_bytes = _head(path)
            if not head:
                self.starts.append(0)
                continue
            fields = _split(head[0], delimiter)
            has_header = header if header is not None else \
                any(f and not _number(f) for f in fields)
            file_names = fields if has_header else list(range(len(fields)))
            if names is None:
                names, self.header, self.first = file_names, has_header, path
            elif len(file_names) != len(names) or (has_header and self.header
                                                    and file_names != names):
                raise ReaderError("%s and %s have different columns: %s vs %s"
                                  % (self.first, path, names, file_names))
            self.starts.append(first_bytes if has_header else 0)
            if first_data is None:
                rows = head[1:] if has_header else head[:1]
                first_data = _split(rows[0], delimiter) if rows else None
        if names is None:
            raise ReaderError("%s: empty file" % self.paths[0])
        self.names, self.ncols = names, len(names)
        self.label_columns = [self._index(c) for c in as_names(labels) or []]
        if features is None:
            numeric = [i for i in range(self.ncols) if first_data is None
                       or i >= len(first_data) or _number(first_data[i] or "0")]
            self.feature_columns = [i for i in numeric if i not in self.label_columns]
        else:
            self.feature_columns = [self._index(c) for c in as_names(features)]
        if not self.feature_columns:
            raise ReaderError("%s: no numeric column left for the features" % self.paths[0])
        self.columns = self.feature_columns + self.label_columns
        self.usecols = sorted(set(self.columns))

    def _index(self, spec):
        if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
            if -self.ncols <= spec < self.ncols:
                return int(spec) % self.ncols
            raise ReaderError("%s: no column %d (it has %d columns)"
                              % (self.paths[0], spec, self.ncols))
        if self.header and spec in self.names:
            return self.names.index(spec)
        known = ", ".join(map(repr, self.names)) if self.header else \
            "no header: name columns by index 0..%d" % (self.ncols - 1)
        raise ReaderError("%s: no column %r (%s)" % (self.paths[0], spec, known))

    def column_name(self, index):
        return repr(self.names[index]) if self.header else str(index)

    def byte_range(self, rank, nranks):
        """This rank's part of the data, as (file, first byte, end byte) with whole lines."""
        spans = [size - start for size, start in zip(self.sizes, self.starts)]
        total = sum(spans)
        lo, hi = rank * total // nranks, (rank + 1) * total // nranks
        base = 0
        for fid, (span, start) in enumerate(zip(spans, self.starts)):
            a, b = max(lo, base), min(hi, base + span)
            if a < b:
                first = self._align(fid, a - base + start)
                last = self._align(fid, b - base + start)
                if first < last:
                    yield fid, first, last
            base += span

    def _align(self, fid, offset):
        """The first line start at or after ``offset`` in file ``fid``."""
        if offset <= self.starts[fid] or offset >= self.sizes[fid]:
            return min(max(offset, self.starts[fid]), self.sizes[fid])
        with open(self.paths[fid], "rb") as f:
            f.seek(offset - 1)
            pos = offset - 1
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    return self.sizes[fid]
                found = chunk.find(b"\n")
                if found >= 0:
                    return pos + found + 1
                pos += len(chunk)


class _BadLine(Exception):
    """A line that does not parse: ``line`` is its index in the block (None if unknown)."""

    def __init__(self, line, message):
        super().__init__(message)
        self.line, self.message = line, message


_native_lock = threading.Lock()
# module: the native parser once built (None: not built, or it cannot be); tried: a build was tried
_native = _state.namespace("readers.csv", module=None, tried=False)


def native():
    """The native parser module, built on first use; None (said once) if it cannot be."""
    with _native_lock:
        if not _native.tried:
            _native.tried = True
            try:
                from matex import _build

                name = "_matex_csvparse"
                path = _build.csvparse_dir() / (name + sysconfig.get_config_var("EXT_SUFFIX"))
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _native.module = module
            except Exception as exc:  # noqa: BLE001 - any failure: parse with pandas
                print("matex: the native CSV parser is unavailable, CSV files are parsed "
                      "with pandas (slower): %s" % str(exc).strip(), file=sys.stderr, flush=True)
    return _native.module


def _delimiter_byte(delimiter):
    """The delimiter as the one byte the native parser takes, or None."""
    raw = delimiter.encode() if isinstance(delimiter, str) else bytes(delimiter)
    return raw[0] if len(raw) == 1 and raw not in (b'"', b"\n", b"\r") else None


def parse(data, layout, serial=None):
    """Rows of the text ``data`` (whole lines) as float32, columns in ``layout.columns`` order.

    Natively unless the delimiter is not one byte, a quote is left open at a
    line end or the native parser is unavailable; then with pandas (under
    the lock ``serial`` if given).
    """
    module = native()
    delimiter = _delimiter_byte(layout.delimiter)
    if module is not None and delimiter is not None:
        values, error = module.parse(data, delimiter, layout.ncols, layout.columns)
        if values is not None:
            return values
        if error is not None:
            line, column, count, field = error
            if column < 0:
                raise _BadLine(line, "has %d fields, expected %d" % (count, layout.ncols))
            text = field.decode("utf-8", "replace")
            shown = text.strip().strip('"').strip() or text     # as _split shows it
            raise _BadLine(line, "column %s: %r is not a number"
                           % (layout.column_name(column), shown))
    with serial or contextlib.nullcontext():
        return parse_pandas(data, layout)


def parse_pandas(data, layout):
    """``parse`` with pandas' C parser.

    Numbers parse without NaN detection first (the fast path); only data with
    empty or other non-numeric fields is parsed again with empty fields as NaN.
    """
    import pandas as pd

    data = bytes(data)

    options = dict(sep=layout.delimiter, header=None, engine="c", index_col=False)
    subset = len(layout.usecols) < layout.ncols
    if subset:
        options["usecols"] = layout.usecols
    try:
        frame = pd.read_csv(io.BytesIO(data), na_filter=False, **options)
        fast = all(dtype.kind in "biuf" for dtype in frame.dtypes)
        if not fast:        # empty fields (or short lines) read as NaN, or a bad field
            frame = pd.read_csv(io.BytesIO(data), dtype=np.float32, keep_default_na=False,
                                na_values=[""], **options)
    except (ValueError, pd.errors.ParserError) as exc:
        raise _locate(data, layout, str(exc).strip()) from None
    # a short line gives an empty field: count the fields unless the fast path saw them all
    if frame.shape[1] != len(layout.usecols) or ((subset or not fast) and b'"' not in data and
            data.count(layout.delimiter.encode()) != len(frame) * (layout.ncols - 1)):
        raise _locate(data, layout, "wrong number of fields")
    return frame[layout.columns].to_numpy(dtype=np.float32)


def _locate(data, layout, detail):
    """The first bad line of ``data`` (which pandas refused), as a _BadLine."""
    text = data.decode("utf-8", "replace")
    for index, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        fields = _split(line, layout.delimiter)
        if len(fields) != layout.ncols:
            return _BadLine(index, "has %d fields, expected %d" % (len(fields), layout.ncols))
        for c in layout.usecols:
            if fields[c] and not _number(fields[c]):
                return _BadLine(index, "column %s: %r is not a number"
                                % (layout.column_name(c), fields[c]))
    return _BadLine(None, detail)


def _blocks(layout, fid, first, last, block_bytes):
    """(offset, text) of consecutive blocks of whole lines covering ``[first, last)``.

    Blocks hold about ``block_bytes``; a rest under half of that joins the last block.
    The text is a memoryview (a block cut at its last line end is not copied).
    """
    fd = os.open(layout.paths[fid], os.O_RDONLY)
    try:
        pos = first
        while pos < last:
            want = last - pos if last - pos < 1.5 * block_bytes else block_bytes
            data = os.pread(fd, want, pos)
            while pos + len(data) < last and data.rfind(b"\n") < 0:    # a line longer than a block
                data += os.pread(fd, min(block_bytes, last - pos - len(data)), pos + len(data))
            size = data.rfind(b"\n") + 1 if pos + len(data) < last else len(data)
            if not size:
                raise ReaderError("%s: file shrank while being read" % layout.paths[fid])
            yield pos, memoryview(data)[:size]
            pos += size
    finally:
        os.close(fd)


def scan(layout, rank, nranks, block_bytes, keep):
    """Parse this rank's byte range: ``(blocks, error, parsed)``.

    ``blocks`` lists ``(file, start, end, rows)``; ``error`` is None or
    ``(file, line number or None, message)`` for the first bad line, after
    which scanning stops; ``parsed`` maps ``(file, start)`` to the parsed
    rows of the first blocks, up to ``keep`` bytes of them.
    """
    blocks, parsed, kept = [], {}, 0
    for fid, first, last in layout.byte_range(rank, nranks):
        for start, data in _blocks(layout, fid, first, last, block_bytes):
            try:
                values = parse(data, layout)
            except _BadLine as bad:
                line = bad.line
                if line is not None:
                    line += _lines_before(layout, fid, start) + 1
                return blocks, (fid, line, bad.message), parsed
            blocks.append((fid, start, start + len(data), len(values)))
            if kept + values.nbytes <= keep:
                parsed[fid, start] = values
                kept += values.nbytes
    return blocks, None, parsed


def _lines_before(layout, fid, offset):
    """Lines of file ``fid`` before byte ``offset`` (a line start), its header included."""
    count, fd = 0, os.open(layout.paths[fid], os.O_RDONLY)
    try:
        for pos in range(0, offset, 1 << 24):
            count += os.pread(fd, min(1 << 24, offset - pos), pos).count(b"\n")
    finally:
        os.close(fd)
    return count


def merge(layout, parts):
    """All ranks' blocks in file order; raises ReaderError for the first bad line anywhere.

    ``parts`` are every rank's ``(blocks, error)`` from ``scan``.
    """
    for _, error in parts:
        if error is not None:
            fid, line, message = error
            path, header = layout.paths[fid], 1 if layout.starts[fid] else 0
            if line is None:
                raise ReaderError("%s: cannot parse its lines: %s" % (path, message))
            raise ReaderError("%s: line %d (data row %d) %s" % (path, line, line - header,
                                                               message))
    return [b for part, _ in parts for b in part if b[3] > 0]


class CsvTable(Table):
    """The blocks of a CSV data set as units: fields ``x`` (features) and ``y`` (labels)."""

    def __init__(self, layout, blocks):
        self.layout, self.blocks = layout, blocks
        self.path = layout.paths[0]
        rows = np.array([b[3] for b in blocks], dtype=np.int64)
        self.num_rows = int(rows.sum())
        self.unit_starts = np.concatenate(([0], np.cumsum(rows)[:-1])).astype(np.int64)
        self.groups = [(0, self.num_rows)]
        self.nx = len(layout.feature_columns)
        ny = len(layout.label_columns)
        self.fields = {"x": (np.dtype(np.float32), (self.nx,))}
        if ny:
            self.fields["y"] = (np.dtype(np.float32), () if ny == 1 else (ny,))
        # parsing a block takes its text, the float32 rows and (pandas) its columns, 8 bytes
        # a field: up to 5x the text, plus what the allocators of the threads parsing keep
        # of them: count 8x (the native parser needs less, the slack stays useful)
        self.decode_bytes = 8 * max((b[2] - b[1] for b in blocks), default=0)
        self._units = {(b[0], b[1]): i for i, b in enumerate(blocks)}
        # the pandas fallback parses one block at a time, as it always did; the native
        # parser releases the GIL and runs in every reader thread (2 threads: 2x as fast)
        self._parsing = threading.Lock()
        self._fds = [os.open(p, os.O_RDONLY) for p in layout.paths]

    def read_unit(self, unit, out):
        fid, start, end, rows = self.blocks[unit]
        data = os.pread(self._fds[fid], end - start, start)
        try:
            values = parse(data, self.layout, serial=self._parsing)
        except _BadLine as bad:
            raise ReaderError("%s: bytes %d-%d changed since opened: %s"
                              % (self.layout.paths[fid], start, end, bad.message)) from None
        if len(values) != rows:
            raise ReaderError("%s: bytes %d-%d changed since opened"
                              % (self.layout.paths[fid], start, end))
        self.fill(values, out)

    def unit_of(self, fid, start):
        """The unit (block) of file ``fid`` starting at byte ``start``."""
        return self._units[fid, start]

    def fill(self, values, out):
        """Write parsed rows ``values`` into ``out`` (fields ``x`` and maybe ``y``)."""
        out["x"][...] = values[:, :self.nx]
        if "y" in out:
            out["y"][...] = values[:, self.nx:].reshape(out["y"].shape)

    def close(self):
        for fd in self._fds:
            os.close(fd)
        self._fds = []
