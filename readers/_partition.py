"""Partition of samples among ranks: epoch orders, each rank's batches, re-division of the rest.

Each rank owns a contiguous segment of the epoch's order, whole samples, and
every rank gets the same number of full batches; the remainder below one
global batch is dropped (``EpochPlan``). (``fit``'s own slicing of global
batches, which keeps every row, is ``matex/_batch_slicing.py``.)

Pure NumPy, no MPI: every rank computes the same arrays from the same
arguments, which is what keeps ranks in agreement without communication.
"""

import numpy as np


def split_validation(groups, fraction):
    """Train and validation row ranges: the last ``round(len * fraction)`` rows of each group.

    ``groups`` is a sequence of ``(start, stop)`` ranges; returns two int64
    arrays of shape (k, 2).
    """
    train, validation = [], []
    for start, stop in groups:
        cut = stop - int(round((stop - start) * fraction))
        train.append((start, cut))
        validation.append((cut, stop))
    as_array = lambda ranges: np.array([r for r in ranges if r[1] > r[0]],  # noqa: E731
                                       dtype=np.int64).reshape(-1, 2)
    return as_array(train), as_array(validation)


def pieces(ranges, unit_starts=None):
    """The ranges cut at unit boundaries: int64 arrays ``(starts, stops)``.

    ``unit_starts`` (sorted row numbers where units begin) is None for data
    read row by row, in which case the ranges are returned whole.
    """
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    if unit_starts is None:
        return ranges[:, 0].copy(), ranges[:, 1].copy()
    starts, stops = [], []
    for start, stop in ranges:
        inner = unit_starts[(unit_starts > start) & (unit_starts < stop)]
        cuts = np.concatenate(([start], inner, [stop])).astype(np.int64)
        starts.append(cuts[:-1])
        stops.append(cuts[1:])
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts), np.concatenate(stops)


def index_dtype(rows):
    """int32 when every row number below ``rows`` fits in it (half the memory), else int64."""
    return np.int32 if rows < 2**31 else np.int64


def rows_of(starts, stops):
    """All rows of the pieces ``[starts[i], stops[i])``, piece after piece (one array)."""
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    total = int((stops - starts).sum())
    rows = np.ones(total, index_dtype(int(stops.max()) if len(stops) else 0))
    if total:
        firsts = np.concatenate(([0], np.cumsum(stops - starts)[:-1]))
        rows[firsts[1:]] = starts[1:] - stops[:-1] + 1     # jump from the previous piece's end
        rows[0] = starts[0]
        np.cumsum(rows, out=rows)
    return rows


def epoch_order(starts, stops, seed, epoch, shuffle, by_row):
    """The order in which one epoch visits the rows of the pieces.

    Without ``shuffle``: piece after piece, row after row. With it, a
    permutation drawn from ``(seed, epoch)`` alone: of single rows when
    ``by_row``, otherwise of whole pieces (units), kept intact.
    """
    if not shuffle:
        return rows_of(starts, stops)
    rng = np.random.default_rng([seed, epoch])
    if by_row:
        rows = rows_of(starts, stops)
        rng.shuffle(rows)
        return rows
    perm = rng.permutation(len(starts))
    return rows_of(starts[perm], stops[perm])


def shuffle_windows(order, size, key):
    """Shuffle ``order`` in place within windows of ``size`` rows, drawn from ``key``."""
    rng = np.random.default_rng(list(key))
    for begin in range(0, len(order), size):
        rng.shuffle(order[begin:begin + size])


class EpochPlan:
    """One pass over ``order`` divided among ``nranks`` ranks in batches of ``batch`` rows.

    Rank r owns the contiguous segment ``order[r * share:(r + 1) * share]``
    and reads it batch after batch, so every rank takes the same number of
    steps. With ``drop_remainder`` every batch is full (share = steps *
    batch) and the last ``len(order) - nranks * share`` rows of the order are
    left out; without it each rank gets ``len(order) // nranks`` rows and its
    last batch may be short. ``window`` shuffles each segment within windows
    of that many rows, drawn from ``key`` (a tuple of ints such as
    ``(seed, epoch)``) and the rank.
    """

    def __init__(self, order, nranks, batch, drop_remainder=True, window=None, key=(0, 0)):
        self.order = np.asarray(order)
        self.nranks, self.batch, self.drop_remainder = int(nranks), int(batch), drop_remainder
        n = len(self.order)
        if drop_remainder:
            self.steps = n // (self.batch * self.nranks)
            self.share = self.steps * self.batch
        else:
            self.share = n // self.nranks
            self.steps = -(-self.share // self.batch)
        if window is not None:
            for r in range(self.nranks):
                shuffle_windows(self.segment(r), window, tuple(key) + (1, r))

    def segment(self, rank):
        """The rows rank ``rank`` reads, in reading order (a view)."""
        return self.order[rank * self.share:(rank + 1) * self.share]

    def groups(self, rank, most):
        """Rank ``rank``'s batches in order, in runs of up to ``most`` batches of one size.

        A list of ``(rows, count)``: ``rows`` (a view) holds ``count``
        consecutive batches of ``len(rows) // count`` rows each.
        """
        seg, b = self.segment(rank), self.batch
        full = len(seg) // b
        out = [(seg[i * b:min(i + most, full) * b], min(most, full - i))
               for i in range(0, full, most)]
        if len(seg) % b:
            out.append((seg[full * b:], 1))
        return out

    def remaining(self, steps_done):
        """The rows not read once every rank has taken ``steps_done`` steps, in plan order.

        Each rank's unread rows follow one another rank after rank, then the
        rows the plan leaves out.
        """
        done = min(int(steps_done), self.steps) * self.batch
        parts = [self.segment(r)[done:] for r in range(self.nranks)]
        parts.append(self.order[self.nranks * self.share:])
        return np.concatenate(parts)
