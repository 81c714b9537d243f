"""The readers' single-process parts: sharding math, the unit cache, CSV byte ranges."""

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from matex.readers import _partition
from matex.readers._csv import Layout
from matex.readers._pipeline import stream
from matex.readers._reader import Reader


def plan_for(n, nranks, batch, shuffle=True, epoch=0, units=None, window=None):
    starts, stops = _partition.pieces([(0, n)], units)
    order = _partition.epoch_order(starts, stops, 7, epoch, shuffle, units is None)
    return _partition.EpochPlan(order, nranks, batch, window=window, key=(7, epoch))


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
    plan = _partition.EpochPlan(np.arange(103), 4, 8, drop_remainder=False)
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
    second = _partition.EpochPlan(rest, new, batch)
    after = np.concatenate([second.segment(r) for r in range(new)])
    assert second.steps == len(rest) // (batch * new)
    assert len(np.unique(np.concatenate([consumed, after]))) == len(consumed) + len(after)
    assert n - len(consumed) - len(after) < batch * new


def test_split_validation_per_group():
    train, validation = _partition.split_validation([(0, 100), (100, 130)], 0.1)
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


# ---- the native CSV parser against the pandas path ----------------------------------

def csv_layout(tmp_path, ncols, features, labels=None, delimiter=","):
    names = [chr(ord("a") + i) for i in range(ncols)]
    path = tmp_path / "layout.csv"
    path.write_text(delimiter.join(names) + "\n" + delimiter.join(["1"] * ncols) + "\n")
    return Layout([str(path)], features, labels, True, delimiter)


def outcome(parse, data, layout):
    """("ok", array) or ("bad", line, message) of ``parse(data, layout)``."""
    from matex.readers._csv import _BadLine

    try:
        return ("ok", parse(data, layout))
    except _BadLine as bad:
        return ("bad", bad.line, bad.message)


def assert_same(data, layout):
    from matex.readers import _csv

    native, pandas = outcome(_csv.parse, data, layout), outcome(_csv.parse_pandas, data, layout)
    if pandas[0] == "ok":
        assert native[0] == "ok", (data, native, pandas)
        assert native[1].dtype == np.float32 and native[1].shape == pandas[1].shape, data
        assert np.array_equal(native[1], pandas[1], equal_nan=True), (data, native, pandas)
    elif pandas[1] is None and native != pandas:    # pandas could not tell the line
        assert native[0] == "bad" and native[1] is not None, (data, native, pandas)
    else:
        assert native == pandas, data


EDGE_CASES = [
    b"1,2,3\n4,5,6\n", b"1,2,3\r\n4,5,6\r\n", b"1,2,3\n4,5,6", b"1,2,3\r4,5,6\r",
    b"1,2,3\r\n\r\n4,5,6\r\n", b"1,2,3\r\n4,5,6\r\r\n", b"1,2,3\n4,5,6\n\r\n",
    b" 1, 2 ,3 \n4,5,6\n", b"\t1,2,3\n1\t,2,3 \r\n", b"1,2,3\x0b\n4,5,6\x0c\n",
    b"1,,3\n4,5,\n", b",,\n4,5,6\n", b"1,2,3\n,,\n", b"0.1,,3\n4,5,6\n",
    b"1,2,3\n\n4,5,6\n", b"1,2,3\n   \n4,5,6\n", b"\n1,2,3\n4,5,6\n\n\n", b"1,2,3\n\t\n4,5,6\n",
    b"1,2\n4,5,6\n", b"1,2,3,4\n4,5,6\n", b"1,2,3\n4,5,6,7\n", b"1,2,3,\n4,5,6,\n",
    b"1,2,3\n4,,6\n7,8\n", b"1,2,3\n4,5,6\n7,8,9,\n", b"1,2,3\n,,,\n", b"1,2,3\n4,x,6\n",
    b"1,x,3\n4,5\n", b"1,2,3\n4,5,6\x00\n", b"1,2,3\n4,5,\xc3\xa9\n", b"1,2,3\n4,5,6\x1a\n",
    b"inf,2,3\n-inf,5,6\n", b"Infinity,INF,iNf\n-Infinity,+inf,infinity\n",
    b"True,2,3\nFalse,5,6\n", b"true,,3\nfalse,5,6\n", b"TRUE,2,3\nFALSE,5,6\n",
    b"yes,2,3\nno,5,6\n", b"+1,2,3\n.5,5.,-.5\n", b"1e5,2E-3,3\n1.5E+03,-1e-05,0001\n",
    b"99999999999999999999,9223372036854775807,3\n4,5,6\n", b"1e400,-1e400,1e-50\n4,5,6\n",
    b"1e-320,2,3\n4,5,6\n", b"3.4028235e38,2,3\n3.4028236e38,5,6\n",
    b"1.00000005960464477539062500001,2,3\n4,5,6\n", b"0.1000000000000000055511151231257827,1,2\n",
    b"1e,2,3\n", b"1e+,2,3\n", b"e5,2,3\n", b".,2,3\n", b"+,2,3\n", b"-,2,3\n", b"+-1,2,3\n",
    b"--1,2,3\n", b"- 1,2,3\n", b"1 2,2,3\n", b"1.2.3,2,3\n", b"1d5,2,3\n", b"#1,2,3\n",
    b"0x10,2,3\n", b"infx,2,3\n", b"\xef\xbb\xbf1,2,3\n4,5,6\n",
    # pandas fails without naming the line; the native parser names it
    b"nan,2,3\n", b"1,NaN,3\n", b"-nan,2,3\n", b"1_000,2,3\n", b"1,2, \n4,5,6\n",
    b" ,2,3\n", b"1,2,3\n\t,5,6\n",
    # quoted fields; a quote left open at a line end goes to pandas
    b'"1",2,3\n4,"5.5",6\n', b'1,2,"x"\n4,5,"y, z"\n', b'"",2,3\n1,2,3\n"",,\n',
    b'" 1 ",2,3\n"1" ,2,3\n', b'"-1e3",2,3\n', b'1,2,"3"\r\n4,5,6\r\n', b'"x",2,3\n',
    b'1,"x"y,3\n', b'1,2,"a""b"\n', b'"1\n2",2,3\n', b'1,"2\n', b'"1,2,3\n',
]


@pytest.mark.parametrize("features", [["a", "b", "c"], ["c", "a"], ["a"], ["b", "b"]])
def test_native_csv_parser_reads_as_pandas(tmp_path, features):
    from matex.readers import _csv

    assert _csv.native() is not None            # the normal path is native
    layout = csv_layout(tmp_path, 3, features)
    for data in EDGE_CASES:
        assert_same(data, layout)


@pytest.mark.parametrize("delimiter", [";", "\t", "|"])
def test_native_csv_parser_other_delimiters(tmp_path, delimiter):
    layout = csv_layout(tmp_path, 3, ["c", "b"], delimiter=delimiter)
    for data in EDGE_CASES[:30]:
        assert_same(data.replace(b",", delimiter.encode()), layout)


@pytest.mark.parametrize("fmt", ["%.17g", "%.9g", "%.6e", "%g", "%.3f", "%d"])
def test_native_csv_parser_rounds_numbers_as_pandas(tmp_path, fmt):
    from matex.readers import _csv

    rng = np.random.default_rng(len(fmt))
    values = rng.standard_normal((4000, 6)) * 10.0 ** rng.integers(-40, 40, (4000, 6))
    if fmt in ("%.3f", "%d"):
        values = rng.standard_normal((4000, 6)) * 10.0 ** rng.integers(0, 18, (4000, 6))
    text = "".join(",".join(fmt % v for v in row) + "\n" for row in values).encode()
    layout = csv_layout(tmp_path, 6, ["f", "a", "c", "d"], labels="e")
    got = _csv.parse(text, layout)
    assert got.shape == (4000, 5)
    assert np.array_equal(got, _csv.parse_pandas(text, layout))


def test_native_csv_parser_differs_from_pandas_only_where_documented(tmp_path):
    from matex.readers import _csv

    layout = csv_layout(tmp_path, 3, ["a", "b", "c"])
    # a block of blank lines is no rows (pandas: "No columns to parse from file")
    for data in (b"", b"\n", b"\r\n \n"):
        assert _csv.parse(data, layout).shape == (0, 3)
    # True/False read as 1/0 field by field (pandas: only in a column of booleans alone)
    assert np.array_equal(_csv.parse(b"True,2,3\n1,false,6\n", layout), [[1, 2, 3], [1, 0, 6]])
    # errors name the line and the column of the field
    assert outcome(_csv.parse, b"1,2,3\n4,nan,6\n", layout) == \
        ("bad", 1, "column 'b': 'nan' is not a number")
    assert outcome(_csv.parse, b"1,2,3\r\n\r\n4,5,  \r\n", layout) == \
        ("bad", 2, "column 'c': '  ' is not a number")
    # quoted delimiters are no field separators, and a short line is an error with quotes
    assert outcome(_csv.parse, b'1,"2",3\n1,"a,b",3\n', layout) == \
        ("bad", 1, "column 'b': 'a,b' is not a number")
    assert outcome(_csv.parse, b'1,"2",3\n"4",5\n', layout) == \
        ("bad", 1, "has 2 fields, expected 3")
    assert np.array_equal(_csv.parse(b'1,"a,b",3\n', csv_layout(tmp_path, 3, ["c", "a"])),
                          [[3, 1]])


def test_native_csv_parser_releases_the_gil(tmp_path):
    import threading
    import time

    from matex.readers import _csv

    layout = csv_layout(tmp_path, 3, ["a", "b", "c"])
    data = b"0.125,1234.5,-7e-3\n" * 3_000_000
    window, ticks = [], []

    def work():
        window.append(time.perf_counter())
        values = _csv.parse(data, layout)
        window.append(time.perf_counter())
        assert values.shape == (3_000_000, 3)

    thread = threading.Thread(target=work)
    thread.start()
    while thread.is_alive():
        ticks.append(time.perf_counter())
        for _ in range(1000):       # Python bytecode: runs only while this thread has the GIL
            pass
    thread.join()
    start, stop = window
    inside = [t for t in ticks if start + 0.1 * (stop - start) < t < stop - 0.1 * (stop - start)]
    assert len(inside) > 100, (stop - start, len(ticks))


def test_csv_without_native_parser_says_so_once_and_uses_pandas(tmp_path):
    import os
    import subprocess
    import sys

    code = ("from matex.readers import _csv\n"
            "class L: ncols, columns, usecols, delimiter = 2, [1, 0], [0, 1], ','\n"
            "for _ in range(3):\n"
            "    print(_csv.parse(b'1,2\\n3,\\n', L()).tolist())\n"
            "print(_csv.native())\n")
    env = {**os.environ, "CXX": "/nonexistent/g++", "MATEX_BUILD_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:4] == ["[[2.0, 1.0], [nan, 3.0]]"] * 3 + ["None"]
    assert proc.stderr.count("native CSV parser is unavailable") == 1, proc.stderr
    assert "no C++ compiler found" in proc.stderr


def test_native_csv_parser_build_is_cached(tmp_path, monkeypatch):
    import sysconfig

    from matex import _build

    monkeypatch.setenv("MATEX_BUILD_DIR", str(tmp_path))
    first = _build.csvparse_dir()
    assert first.parent == tmp_path and first.name.startswith("csvparse-")
    assert (first / ("_matex_csvparse" + sysconfig.get_config_var("EXT_SUFFIX"))).is_file()
    assert _build.csvparse_dir() == first


# ---- batches gathered inside tf.data (tables read row by row) -----------------------

def test_buffer_pool_reuses_only_arrays_nobody_holds():
    from matex.readers._gather import BufferPool

    pool = BufferPool(keep=2)
    a = pool.get((4, 3), np.float32)
    assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous
    held = pool.get((4, 3), np.float32)
    assert held is not a
    a_id = id(a)
    del a
    again = pool.get((4, 3), np.float32)
    assert id(again) == a_id                        # released: reused
    view = held[1:]                                 # a view keeps ``held`` busy
    del held
    third = pool.get((4, 3), np.float32)
    assert third is not again and not np.shares_memory(third, view)
    assert len(pool) == 2                           # never more than ``keep`` retained
    assert pool.get((5, 3), np.float32).shape == (5, 3)


def dataset_batches(dataset):
    """The batches as tuples of arrays (a dataset of bare tensors: 1-tuples)."""
    return [tuple(t.numpy() for t in batch) if isinstance(batch, tuple) else (batch.numpy(),)
            for batch in dataset]


@pytest.mark.parametrize("native,group", [(True, 1), (False, 1), (False, 3)])
def test_gathered_batches_are_the_generator_paths(tmp_path, native, group):
    """Same batches, epoch after epoch, as the generator path; held batches stay intact.

    ``native``: fields stored raw in native byte order go through the source
    op MatexMappedBatchDataset (cast after where the dtype differs), the
    others through numpy_function; without it, all through numpy_function.
    """
    import h5py

    from matex.readers import DataSet

    n = 1000
    x = np.arange(n * 6, dtype=np.float32).reshape(n, 6)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, np.arange(n) * 3
        f["big"] = x.astype(">f8")                   # converted, not gathered as is
        f["wide"] = (x + 0.1).astype("<f8")          # gathered as is, cast to float32
        f["y32"] = (np.arange(n) * 7).astype(np.int32)
        f["s"] = np.arange(n, dtype=np.float32)      # scalar samples: shape (1,)
        f["img"] = np.arange(n * 12, dtype=np.float32).reshape(n, 2, 3, 2)
    cases = [(dict(features="x", labels="y"), True), (dict(features="big", labels="y"), False),
             (dict(features="wide", labels="y32"), True),
             (dict(features=["x", "s"], labels="y"), False),
             (dict(features="s", labels=None), True), (dict(features="img", labels="y"), True)]
    for options, by_op in cases:
        fast = DataSet(str(tmp_path / "d.h5"), per_rank_batch_size=32, validation_split=0.1,
                       seed=5, **options)
        slow = DataSet(str(tmp_path / "d.h5"), per_rank_batch_size=32, validation_split=0.1,
                       seed=5, **options)
        assert fast._gatherer is not None
        assert fast._gatherer.native == by_op, options
        fast._gatherer.native = native and by_op
        fast._gatherer.group = group
        slow._gatherer = None
        try:
            assert fast.train.element_spec == slow.train.element_spec, options
            for _ in range(2):
                got, want = dataset_batches(fast.train), dataset_batches(slow.train)
                assert len(got) == len(want) == fast.steps_per_epoch == len(fast.train)
                for g, w in zip(got, want):
                    assert len(g) == len(w)
                    for a, b in zip(g, w):
                        assert a.dtype == b.dtype and np.array_equal(a, b), options
            got = dataset_batches(fast.validation)
            want = dataset_batches(slow.validation)
            assert [g[0].shape[0] for g in got] == [32, 32, 32, 4]     # short last batch
            assert all(np.array_equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
            assert fast.epoch == slow.epoch == 2
        finally:
            fast.close()
            slow.close()


def test_mapped_batch_dataset_checks_rows_and_file(tmp_path):
    """The source op refuses rows outside the table and a table past the file's end."""
    import tensorflow as tf

    from matex.readers import _gather

    path = tmp_path / "t.bin"
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    path.write_bytes(b"\0" * 16 + table.tobytes())
    source = dict(path=str(path), offset=16, stride=16, num_rows=10, row_shape=[4],
                  dtype="float32")
    rows = tf.constant([9, 0, 3, 3, 7], tf.int64)
    got = [b.numpy() for b in _gather._mapped_batches(rows, tf.constant(2, tf.int64),
                                                     [source])]
    assert [len(b) for b in got] == [2, 2, 1]
    assert np.array_equal(np.concatenate(got), table[[9, 0, 3, 3, 7]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside the table's 10 rows"):
        list(_gather._mapped_batches(tf.constant([1, 10], tf.int64), tf.constant(2, tf.int64),
                                     [source]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="the table ends at byte 192"):
        list(_gather._mapped_batches(rows, tf.constant(2, tf.int64),
                                     [dict(source, offset=32)]))


def test_gathered_epochs_differ_and_cover_every_sample(tmp_path):
    import h5py

    from matex.readers import DataSet, _dataset

    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = np.arange(4096, dtype=np.float32).reshape(-1, 4)
        f["y"] = np.arange(1024)
    with DataSet(str(tmp_path / "d.h5"), per_rank_batch_size=64) as ds:
        assert isinstance(ds._gatherer, _dataset._gather.Gatherer)
        epochs = [np.concatenate([y for _, y in dataset_batches(ds.train)]) for _ in range(2)]
        for labels in epochs:
            assert np.array_equal(np.sort(labels), np.arange(1024))
        assert not np.array_equal(epochs[0], epochs[1])
        first = dataset_batches(ds.train.take(3))           # an epoch left after 3 batches
        assert len(first) == 3 and ds.epoch == 3
        assert len(dataset_batches(ds.train)) == 16          # the next one is whole
