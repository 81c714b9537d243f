"""Tables: a file's selected fields as numbered rows, and several files seen as one.

A table is either read row by row (``unit_starts is None``: ``gather`` any
sorted rows cheaply) or unit by unit (chunks, text blocks: ``read_unit``
decodes one whole unit). Every format backend builds tables; everything
above them (sharding, shuffling, batching) is format-blind.
"""

import numpy as np

from ._errors import ReaderError


def as_names(spec):
    """``None``, one name or a list of names -> None or a list."""
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        return list(spec)
    return [spec]


def select(available, features, labels, where, kind, default=None):
    """Resolve ``features`` and ``labels`` against the fields a file offers.

    ``available`` maps each field name to whether it is a numeric array of
    samples, in file order. ``features=None`` means every such field except
    the labels (only those in ``default``, if given). Returns
    ``(feature_names, label_names)``; raises ReaderError naming ``where``
    (the file) and the ``kind`` of field for a missing or unusable one.
    """
    label_names = as_names(labels) or []
    feature_names = as_names(features)
    if feature_names is None:
        feature_names = [n for n, numeric in available.items()
                         if numeric and n not in label_names and (default is None or n in default)]
        if not feature_names:
            raise ReaderError("%s: no numeric %s left for the features besides the labels %s"
                              % (where, kind, label_names))
    if not feature_names:
        raise ReaderError("%s: features is an empty list" % where)
    for name in feature_names + label_names:
        if name not in available:
            raise ReaderError("%s: no %s %r (it has: %s)"
                              % (where, kind, name, ", ".join(map(repr, available)) or "none"))
        if not available[name]:
            raise ReaderError("%s: %s %r is not a numeric array of samples" % (where, kind, name))
    return feature_names, label_names


def check_lengths(lengths, where):
    """Raise ReaderError unless every field in ``lengths`` (name -> rows) has as many rows."""
    if len(set(lengths.values())) > 1:
        detail = ", ".join("%r has %d" % (n, k) for n, k in lengths.items())
        raise ReaderError("%s: fields have different numbers of samples: %s" % (where, detail))


class Table:
    """Base of all tables. Subclasses set the attributes and implement the reads.

    Attributes: ``path`` (for messages), ``num_rows``, ``fields`` (name ->
    ``(dtype, sample_shape)``), ``groups`` (row ranges that a validation
    split takes its share from, each), ``unit_starts`` (None or the sorted
    first rows of the units), ``decode_bytes`` (scratch memory one unit
    decode needs).
    """

    path = ""
    groups = None
    unit_starts = None
    decode_bytes = 0

    def gather(self, rows):
        """Fields of the sorted ``rows``: name -> array (row-by-row tables)."""
        raise NotImplementedError

    def read_unit(self, unit, out):
        """Write unit ``unit``'s rows into ``out`` (name -> array of its length)."""
        raise NotImplementedError

    def unit_stop(self, unit):
        """One past the last row of unit ``unit``."""
        last = unit + 1 >= len(self.unit_starts)
        return self.num_rows if last else int(self.unit_starts[unit + 1])

    def close(self):
        """Release the files."""


class ConstantColumn:
    """A field whose every row is ``value`` (the class index of the class layout)."""

    unit_rows = 1
    decode_bytes = 0

    def __init__(self, value, num_rows, dtype=np.int64):
        self.value, self.num_rows = value, num_rows
        self.dtype, self.shape = np.dtype(dtype), ()

    def gather(self, rows):
        return np.full(len(rows), self.value, self.dtype)

    def read_into(self, start, stop, out):
        out[...] = self.value


class ColumnTable(Table):
    """Fields stored independently (HDF5 datasets, netCDF variables), read column by column.

    Row by row when every column is; otherwise in units of the largest
    column chunk along the sample axis.
    """

    def __init__(self, path, columns, mapped=None, handle=None):
        self.path, self.columns = path, dict(columns)
        self._mapped, self._handle = mapped, handle
        first = next(iter(self.columns.values()))
        self.num_rows = first.num_rows
        self.fields = {name: (c.dtype, tuple(c.shape)) for name, c in self.columns.items()}
        self.groups = [(0, self.num_rows)]
        self.decode_bytes = sum(c.decode_bytes for c in self.columns.values())
        unit = max(c.unit_rows for c in self.columns.values())
        if unit > 1:
            self.unit_starts = np.arange(0, self.num_rows, unit, dtype=np.int64)

    def gather(self, rows):
        return {name: c.gather(rows) for name, c in self.columns.items()}

    def read_unit(self, unit, out):
        start, stop = int(self.unit_starts[unit]), self.unit_stop(unit)
        for name, c in self.columns.items():
            c.read_into(start, stop, out[name])

    def close(self):
        for f in (self._mapped, self._handle):
            if f is not None:
                f.close()


class Concat(Table):
    """Several tables with the same fields, one after another, as one table.

    Row by row if every member is; otherwise member units (members read row
    by row are cut into units as large as the largest member unit). With
    ``stratified`` the members' groups are kept (validation comes from each
    one); otherwise the whole is one group.
    """

    def __init__(self, members, stratified=False):
        self.members = list(members)
        first = self.members[0]
        self.path = first.path
        self.fields = dict(first.fields)
        for m in self.members[1:]:
            self._check_same_fields(first, m)
            for name, (dtype, shape) in m.fields.items():
                self.fields[name] = (np.result_type(self.fields[name][0], dtype), shape)
        sizes = [m.num_rows for m in self.members]
        self.offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.num_rows = int(self.offsets[-1])
        if stratified:
            self.groups = [(int(o + a), int(o + b))
                           for o, m in zip(self.offsets, self.members) for a, b in m.groups]
        else:
            self.groups = [(0, self.num_rows)]
        self.decode_bytes = max(m.decode_bytes for m in self.members)
        if any(m.unit_starts is not None for m in self.members):
            step = max(int(np.diff(m.unit_starts).max(initial=1))
                       for m in self.members if m.unit_starts is not None)
            self._local_starts = [m.unit_starts if m.unit_starts is not None
                                  else np.arange(0, m.num_rows, step, dtype=np.int64)
                                  for m in self.members]
            counts = [len(s) for s in self._local_starts]
            self._unit_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
            self.unit_starts = np.concatenate(
                [s + o for s, o in zip(self._local_starts, self.offsets)]).astype(np.int64)

    @staticmethod
    def _check_same_fields(a, b):
        if set(a.fields) != set(b.fields):
            raise ReaderError("%s and %s have different fields: %s vs %s"
                              % (a.path, b.path, sorted(a.fields), sorted(b.fields)))
        for name, (_, shape) in a.fields.items():
            other = b.fields[name][1]
            if tuple(shape) != tuple(other):
                raise ReaderError("%s and %s disagree on the shape of %r: %s vs %s (per sample)"
                                  % (a.path, b.path, name, tuple(shape), tuple(other)))

    def _split(self, rows):
        """(member, local rows) for each member that ``rows`` (sorted) touch."""
        cuts = np.searchsorted(rows, self.offsets)
        for i, m in enumerate(self.members):
            if cuts[i + 1] > cuts[i]:
                yield m, rows[cuts[i]:cuts[i + 1]] - self.offsets[i]

    def gather(self, rows):
        parts = [m.gather(local) for m, local in self._split(rows)]
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([p[name] for p in parts]) for name in self.fields}

    def read_unit(self, unit, out):
        i = int(np.searchsorted(self._unit_offsets, unit, side="right")) - 1
        member, local = self.members[i], unit - int(self._unit_offsets[i])
        if member.unit_starts is not None:
            member.read_unit(local, out)
            return
        starts = self._local_starts[i]
        start = int(starts[local])
        stop = int(starts[local + 1]) if local + 1 < len(starts) else member.num_rows
        for name, values in member.gather(np.arange(start, stop, dtype=np.int64)).items():
            out[name][...] = values

    def close(self):
        for m in self.members:
            m.close()
