"""The readers' single-process parts: sharding math, the unit cache, CSV byte ranges."""

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from matex.readers import _sharding
from matex.readers._csv import Layout
from matex.readers._pipeline import stream
from matex.readers._reader import Reader


def plan_for(n, nranks, batch, shuffle=True, epoch=0, units=None, window=None):
    starts, stops = _sharding.pieces([(0, n)], units)
    order = _sharding.epoch_order(starts, stops, 7, epoch, shuffle, units is None)
    return _sharding.EpochPlan(order, nranks, batch, window=window, key=(7, epoch))


def rank_rows(plan, rank):
    groups = plan.groups(rank, 3)
    return [rows[i * (len(rows) // count):(i + 1) * (len(rows) // count)]
            for rows, count in groups for i in range(count)]


@pytest.mark.parametrize("n,nranks,batch", [(100, 1, 7), (100, 3, 7), (1000, 4, 32),
                                            (31, 4, 8), (64, 2, 32)])
def test_every_sample_at_most_once_equal_full_batches(n, nranks, batch):
    plan = plan_for(n, nranks, batch)
    batches = [rank_rows(plan, r) for r in range(nranks)]
    assert {len(b) for b in batches} == {plan.steps} == {n // (batch * nranks)}
    assert all(len(rows) == batch for b in batches for rows in b)
    seen = np.concatenate([np.concatenate(b) for b in batches]) if plan.steps else []
    assert len(seen) == len(set(seen)) == plan.steps * batch * nranks
    assert n - len(seen) < batch * nranks
    assert np.array_equal(np.sort(plan.order), np.arange(n))


def test_permutation_depends_on_seed_and_epoch_only():
    a, b = plan_for(500, 3, 8, epoch=0), plan_for(500, 3, 8, epoch=0)
    c = plan_for(500, 3, 8, epoch=1)
    assert np.array_equal(a.order, b.order) and not np.array_equal(a.order, c.order)
    assert np.array_equal(plan_for(500, 3, 8, shuffle=False).order, np.arange(500))


def test_unit_shuffle_keeps_units_whole_and_windows_local():
    units = np.arange(0, 1000, 50)
    plain = plan_for(1000, 1, 10, units=units)
    runs = plain.order.reshape(-1, 50)
    assert all(np.array_equal(r, np.arange(r[0], r[0] + 50)) for r in runs)
    windowed = plan_for(1000, 2, 10, units=units, window=100)
    for r in range(2):
        seg = windowed.segment(r)
        for w in range(0, len(seg), 100):
            window = seg[w:w + 100]
            assert not np.array_equal(window, np.sort(window))
            assert len(np.unique(window // 50)) <= 3     # two units, or three when cut
    used = lambda plan: np.sort(plan.order[:plan.nranks * plan.share])  # noqa: E731
    assert np.array_equal(used(windowed), used(plain))


def test_validation_plan_keeps_short_last_batch():
    plan = _sharding.EpochPlan(np.arange(103), 4, 8, drop_remainder=False)
    assert plan.share == 25 and plan.steps == 4
    groups = plan.groups(1, 10)
    assert [(len(rows), count) for rows, count in groups] == [(24, 3), (1, 1)]
    assert np.array_equal(np.concatenate([g[0] for g in groups]), np.arange(25, 50))


@pytest.mark.parametrize("n,old,new,batch,done", [(653, 4, 3, 8, 3), (653, 4, 3, 8, 0),
                                                  (1000, 3, 2, 16, 20), (500, 2, 2, 5, 50),
                                                  (97, 2, 1, 4, 12)])
def test_remaining_is_redivided_without_loss_or_repeat(n, old, new, batch, done):
    first = plan_for(n, old, batch)
    consumed = np.concatenate([first.segment(r)[:done * batch] for r in range(old)])
    rest = first.remaining(done)
    assert len(np.intersect1d(rest, consumed)) == 0
    assert np.array_equal(np.sort(np.concatenate([consumed, rest])), np.arange(n))
    second = _sharding.EpochPlan(rest, new, batch)
    after = np.concatenate([second.segment(r) for r in range(new)])
    assert second.steps == len(rest) // (batch * new)
    assert len(np.unique(np.concatenate([consumed, after]))) == len(consumed) + len(after)
    assert n - len(consumed) - len(after) < batch * new


def test_split_validation_per_group():
    train, validation = _sharding.split_validation([(0, 100), (100, 130)], 0.1)
    assert train.tolist() == [[0, 90], [100, 127]]
    assert validation.tolist() == [[90, 100], [127, 130]]


class FakeTable:
    """Rows 0..n-1 in units of ``unit`` rows; counts decodes."""

    def __init__(self, n, unit):
        self.num_rows = n
        self.unit_starts = np.arange(0, n, unit)
        self.fields = {"v": (np.dtype(np.int64), ())}
        self.decodes = 0

    def read_unit(self, unit, out):
        self.decodes += 1
        start = self.unit_starts[unit]
        out["v"][...] = np.arange(start, start + len(out["v"]))


@pytest.mark.parametrize("capacity_units,group_rows", [(40, 8), (4, 8), (2, 64)])
def test_unit_cache_reads_every_group_right(capacity_units, group_rows):
    table = FakeTable(1000, 10)
    rng = np.random.default_rng(0)
    order = rng.permutation(1000)
    groups = [(order[i:i + group_rows], 1) for i in range(0, 1000, group_rows)]
    with ThreadPoolExecutor(2) as pool:
        reader = Reader(table, capacity_units * 10 * 8, pool.submit)
        got = list(stream(reader, groups, lambda fields, o, c: fields["v"][np.argsort(o)],
                          pool.submit, 3))
    assert all(np.array_equal(g, rows) for g, (rows, _) in zip(got, groups))
    assert reader.slots == capacity_units
    assert not reader._pins.any()                           # everything released


def test_unit_cache_keeps_units_while_they_fit():
    table = FakeTable(200, 10)
    groups = [(np.arange(i, i + 10), 1) for i in range(0, 200, 10)]
    with ThreadPoolExecutor(2) as pool:
        reader = Reader(table, 20 * 10 * 8, pool.submit)
        for _ in range(3):
            list(stream(reader, groups, lambda f, o, c: f, pool.submit, 2))
    assert table.decodes == 20


def write_csv(path, lines, header="a,b,c"):
    path.write_text((header + "\n" if header else "") + "".join(lines))


@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 16])
def test_csv_byte_ranges_cover_every_line_once(tmp_path, nranks):
    lines = ["%d,%d,%d\n" % (i, i * i, i % 3) for i in range(300)]
    write_csv(tmp_path / "a.csv", lines)
    write_csv(tmp_path / "b.csv", lines[:17])
    layout = Layout([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")], None, "c", None, ",")
    pieces = list(itertools.chain.from_iterable(layout.byte_range(r, nranks)
                                                for r in range(nranks)))
    texts = {0: (tmp_path / "a.csv").read_bytes(), 1: (tmp_path / "b.csv").read_bytes()}
    got = {0: b"", 1: b""}
    for fid, first, last in pieces:
        assert first == layout.starts[fid] or texts[fid][first - 1:first] == b"\n"
        got[fid] += texts[fid][first:last]
    assert got[0] == "".join(lines).encode() and got[1] == "".join(lines[:17]).encode()
    assert layout.feature_columns == [0, 1] and layout.label_columns == [2]


def test_csv_header_detection(tmp_path):
    write_csv(tmp_path / "h.csv", ["1,2,3\n"])
    write_csv(tmp_path / "n.csv", ["1,2,3\n"], header=None)
    with_header = Layout([str(tmp_path / "h.csv")], None, "c", None, ",")
    without = Layout([str(tmp_path / "n.csv")], None, 2, None, ",")
    assert with_header.header and with_header.starts == [6]
    assert not without.header and without.starts == [0] and without.names == [0, 1, 2]


@pytest.mark.parametrize("filters", [dict(compression="gzip"),
                                     dict(compression="gzip", shuffle=True, fletcher32=True),
                                     dict(compression="lzf"), dict()])
def test_chunked_hdf5_columns_decode_like_h5py(tmp_path, filters):
    import h5py

    from matex.readers._hdf5 import H5Column

    data = np.arange(1000 * 3, dtype=">i4").reshape(1000, 3) * 7
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("x", data=data, chunks=(64, 3), **filters)
        f.create_dataset("sparse", shape=(300, 3), dtype=np.float32, chunks=(64, 3),
                         compression="gzip", fillvalue=-1)[100:130] = 5
    with h5py.File(tmp_path / "c.h5", "r") as f:
        column = H5Column(f["x"])
        assert (column._filters is not None) == (filters.get("compression") != "lzf")
        for start, stop in [(0, 64), (64, 128), (960, 1000), (10, 900), (999, 1000)]:
            out = np.empty((stop - start, 3), column.dtype)
            column.read_into(start, stop, out)
            assert np.array_equal(out, data[start:stop])
        sparse = H5Column(f["sparse"])
        out = np.empty((300, 3), np.float32)
        sparse.read_into(0, 300, out)
        assert np.array_equal(out, f["sparse"][:])
