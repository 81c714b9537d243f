"""matex.readers.DataSet on every format, checked across ranks: each sample once per epoch.

Data files are written by rank 0 into a directory every rank agrees on; a
feature column holds each sample's index, so the samples every rank saw can
be gathered and compared with the expected set.
"""

import os
import shutil
import struct
import tempfile
from pathlib import Path

import h5py
import netCDF4
import numpy as np
import pytest

import matex
from matex import _batch_slicing
from matex.readers import DataSet, ReaderError, _dataset
from subcomm import SubCommunicator

R, N = matex.rank(), matex.size()
B = 8                           # per-rank batch of most tests (per_rank_batch_size=B)
FEATURES = 3                    # x[:, 0] is the sample index, x[:, 1:] derived from it


@pytest.fixture(scope="module")
def shared():
    """A directory all ranks share (in the suite's report dir, else a temp dir); removed after."""
    base = os.environ.get("MATEX_TEST_REPORT_DIR")
    if R == 0:
        path = os.path.join(base, "readers-data") if base else tempfile.mkdtemp()
        os.makedirs(path, exist_ok=True)
    path = matex.comm().bcast(path if R == 0 else None, root=0)
    yield Path(path)
    matex.comm().Barrier()
    if R == 0:
        shutil.rmtree(path, ignore_errors=True)


def written(path, write):
    """``path`` after rank 0 ran ``write(path)`` (once), every rank past a barrier."""
    if R == 0 and not path.exists():
        tmp = path.with_name(path.name + ".part" + path.suffix)
        write(tmp)
        os.replace(tmp, path)
    matex.comm().Barrier()
    return str(path)


def samples(n, start=0):
    """Features of samples ``start..start+n-1``: index, 2*index, index mod 7."""
    idx = np.arange(start, start + n, dtype=np.float64)
    return np.stack([idx, 2 * idx, idx % 7], axis=1).astype(np.float32)


def label_of(index):
    return (np.asarray(index, dtype=np.int64) * 5) % 11


# ---- writers ------------------------------------------------------------------

def h5_writer(n, start=0, chunks=None, features=FEATURES, labels=True):
    def write(path):
        with h5py.File(path, "w") as f:
            x = samples(n, start)
            if features != FEATURES:
                x = np.repeat(x[:, :1], features, axis=1)
            f.create_dataset("x", data=x, chunks=chunks,
                             compression="gzip" if chunks else None)
            if labels:
                f.create_dataset("y", data=label_of(np.arange(start, start + n)))
    return write


def csv_writer(n, header, start=0, names="id,double,mod7,label"):
    def write(path):
        x = samples(n, start)
        with open(path, "w") as f:
            if header:
                f.write(names + "\n")
            for row, label in zip(x, label_of(np.arange(start, start + n))):
                f.write("%d,%d,%d,%d\n" % (row[0], row[1], row[2], label))
    return write


def nc_writer(n, fmt, unlimited):
    def write(path):
        with netCDF4.Dataset(path, "w", format=fmt) as d:
            d.createDimension("sample", None if unlimited else n)
            d.createDimension("feature", FEATURES)
            d.createVariable("sample", "i4", ("sample",))[:] = np.arange(n)
            d.createVariable("x", "f4", ("sample", "feature"))[:] = samples(n)
            d.createVariable("y", "i4", ("sample",))[:] = label_of(np.arange(n))
            d.createVariable("other", "f8", ("feature",))[:] = [1, 2, 3]
            d.title = "readers test"
    return write


def cdf_writer(n, version, unlimited, align=512):
    """A CDF file laid out the way PnetCDF writes it: padded header, aligned variables."""
    big = version == 5
    count = (lambda v: struct.pack(">Q", v)) if big else (lambda v: struct.pack(">I", v))
    offset = (lambda v: struct.pack(">Q", v)) if version != 1 else (lambda v: struct.pack(">I", v))

    def name(text):
        raw = text.encode()
        return count(len(raw)) + raw + b"\0" * (-len(raw) % 4)

    x = samples(n).astype(">f4")
    y = label_of(np.arange(n)).astype(">i8" if big else ">i4")
    ytype = 10 if big else 4

    def header(begins):
        out = b"CDF" + bytes([version]) + count(n if unlimited else 0)
        out += struct.pack(">I", 0x0A) + count(2)
        out += name("sample") + count(0 if unlimited else n) + name("feature") + count(FEATURES)
        out += struct.pack(">I", 0x0C) + count(1) + name("source") + struct.pack(">I", 2) \
            + count(7) + b"pnetcdf\0"
        out += struct.pack(">I", 0x0B) + count(2)
        for vname, dimids, nc_type, vsize, begin in (
                ("x", [0, 1], 5, FEATURES * 4 * (1 if unlimited else n), begins[0]),
                ("y", [0], ytype, y.itemsize * (1 if unlimited else n), begins[1])):
            out += name(vname) + count(len(dimids)) + b"".join(count(d) for d in dimids)
            out += struct.pack(">I", 0) + count(0)            # no attributes
            out += struct.pack(">I", nc_type) + count(vsize) + offset(begin)
        return out

    def up(v):
        return -(-v // align) * align

    start = up(len(header((0, 0))) + 200)                     # free space after the header
    if unlimited:
        begins = (start, start + FEATURES * 4)
        recsize = FEATURES * 4 + y.itemsize
        body = bytearray(recsize * n)
        view = np.frombuffer(body, np.uint8).reshape(n, recsize)
        view[:, :FEATURES * 4] = x.view(np.uint8).reshape(n, -1)
        view[:, FEATURES * 4:] = y.view(np.uint8).reshape(n, -1)
        data = bytes(body)
    else:
        begins = (start, up(start + x.nbytes))
        data = x.tobytes() + b"\0" * (begins[1] - start - x.nbytes) + y.tobytes()
    head = header(begins)

    def write(path):
        with open(path, "wb") as f:
            f.write(head + b"\0" * (start - len(head)) + data)
    return write


# ---- checks -------------------------------------------------------------------

def batches_of(dataset):
    """This rank's batches of one pass over a tf.data.Dataset, as NumPy tuples."""
    out = []
    for batch in dataset:
        batch = batch if isinstance(batch, tuple) else (batch,)
        out.append(tuple(t.numpy() for t in batch))
    return out


def run_epoch(ds):
    """(ids of this rank's samples per batch, label mismatches, per-batch sizes) of one epoch."""
    got = batches_of(ds.train)
    ids = [b[0][:, 0].astype(np.int64) for b in got]
    bad = sum(int((b[1] != label_of(b[0][:, 0])).sum()) for b in got if len(b) > 1)
    return ids, bad, [len(i) for i in ids]


def check_epochs(ds, train_ids, validation_ids=(), epochs=2, labels=True):
    """Each epoch: the ranks' batches are disjoint, full, equal in number; order changes."""
    orders = []
    for _ in range(epochs):
        ids, bad, sizes = run_epoch(ds)
        everyone = matex.comm().allgather((ids, bad, sizes, ds.steps_per_epoch))
        steps = {len(e[0]) for e in everyone} | {e[3] for e in everyone}
        assert steps == {ds.steps_per_epoch}, steps
        assert all(set(e[2]) == {ds.per_rank_batch_size} for e in everyone)
        if labels:
            assert sum(e[1] for e in everyone) == 0, "labels do not match their samples"
        seen = np.concatenate([np.concatenate(e[0]) for e in everyone])
        assert len(seen) == ds.steps_per_epoch * ds.batch_size
        assert len(np.unique(seen)) == len(seen), "a sample was read twice in one epoch"
        assert set(seen.tolist()) <= set(train_ids)
        assert len(train_ids) - len(seen) < ds.batch_size
        orders.append(seen)
    if ds.shuffle:
        assert not np.array_equal(orders[0], orders[1]), "same order in two epochs"
    if len(validation_ids):
        check_validation(ds, train_ids, validation_ids)


def check_validation(ds, train_ids, validation_ids):
    got = batches_of(ds.validation)
    everyone = matex.comm().allgather([b[0][:, 0].astype(np.int64) for b in got])
    assert {len(e) for e in everyone} == {ds.validation_steps}
    seen = np.concatenate([np.concatenate(e) for e in everyone])
    assert len(np.unique(seen)) == len(seen)
    assert set(seen.tolist()) <= set(validation_ids)
    assert not set(seen.tolist()) & set(train_ids)
    assert len(validation_ids) - len(seen) < N
    mine = np.concatenate(everyone[R])
    assert np.array_equal(mine, np.sort(mine)), "validation is not read in order"


def split_ids(n, fraction, start=0):
    cut = n - int(round(n * fraction))
    return list(range(start, start + cut)), list(range(start + cut, start + n))


# ---- formats ------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "chunked-gzip"])
def test_hdf5(shared, layout):
    n = 611
    path = written(shared / ("%s.h5" % layout),
                   h5_writer(n, chunks=(7, FEATURES) if layout != "contiguous" else None))
    budget = None if layout == "contiguous" else 18_000    # some of the 88 chunks at a time
    ds = DataSet(path, per_rank_batch_size=B, validation_split=0.1, seed=3, memory_budget=budget)
    if budget:                                             # the shuffle works in windows
        assert ds._reader.slots < len(ds._table.unit_starts) and ds._window < n
    train, validation = split_ids(n, 0.1)
    assert ds.num_samples == len(train) and ds.num_validation_samples == len(validation)
    check_epochs(ds, train, validation)
    ds.close()


def test_hdf5_same_order_on_every_rank_and_per_seed(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    first = DataSet(path, per_rank_batch_size=B, seed=5)
    again = DataSet(path, per_rank_batch_size=B, seed=5)
    other = DataSet(path, per_rank_batch_size=B, seed=6)
    a, b, c = run_epoch(first)[0], run_epoch(again)[0], run_epoch(other)[0]
    same = matex.comm().allgather(all(np.array_equal(x, y) for x, y in zip(a, b)))
    differ = matex.comm().allgather(any(not np.array_equal(x, y) for x, y in zip(a, c)))
    assert all(same) and all(differ)
    # the permutation itself, computed on each rank alone, is bitwise the same everywhere
    orders = matex.comm().allgather(first._train_plan(7).order.tobytes())
    assert len(set(orders)) == 1


def test_unshuffled_epochs_read_in_order(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, per_rank_batch_size=B, shuffle=False)
    ids = np.concatenate(run_epoch(ds)[0])
    share = ds.steps_per_epoch * B
    assert np.array_equal(ids, np.arange(R * share, (R + 1) * share))
    check_epochs(ds, list(range(611)))


def test_hdf5_classes(shared):
    counts = [150, 90, 201]

    def write(path):
        with h5py.File(path, "w") as f:
            start = 0
            for k, c in enumerate(counts):
                f["%d" % k] = samples(c, start)
                start += c
    path = written(shared / "classes.h5", write)
    ds = DataSet(path, format="hdf5-classes", features=None, per_rank_batch_size=B,
                 validation_split=0.2)
    assert ds.class_names == ["0", "1", "2"]
    bounds = np.cumsum([0] + counts)
    train, validation = [], []
    for k, c in enumerate(counts):
        t, v = split_ids(c, 0.2, bounds[k])
        train += t
        validation += v
    got = batches_of(ds.train)
    klass = np.searchsorted(bounds, np.concatenate([b[0][:, 0] for b in got]), side="right") - 1
    labels = np.concatenate([b[1] for b in got])
    assert labels.dtype == np.int64 and np.array_equal(labels, klass)
    check_epochs(ds, train, validation, labels=False)
    plain = DataSet(path, format="hdf5-classes", features=None, labels=None, per_rank_batch_size=B)
    assert next(iter(plain.train)).shape == (B, FEATURES) and plain.training_labels is None


@pytest.mark.parametrize("header", [True, False])
def test_csv(shared, header):
    n = 5003                                               # ~90 KB: several blocks per file
    path = written(shared / ("header.csv" if header else "plain.csv"), csv_writer(n, header))
    if header:
        ds = DataSet(path, features=["id", "double", "mod7"], labels="label",
                     per_rank_batch_size=B, validation_split=0.1, memory_budget=4 << 20)
    else:
        ds = DataSet(path, features=[0, 1, 2], labels=3, per_rank_batch_size=B,
                     validation_split=0.1, memory_budget=4 << 20)
    train, validation = split_ids(n, 0.1)
    check_epochs(ds, train, validation)
    x = ds.training_data
    assert x.dtype == np.float32 and x.shape == (ds.steps_per_epoch * B, 3)
    assert np.array_equal(ds.training_labels, label_of(x[:, 0]))


def messy_csv_writer(n):
    """CRLF line ends, blank lines, blanks around numbers, empty fields, a quoted text column."""
    def write(path):
        with open(path, "w", newline="") as f:
            f.write('id,"name",value,label\r\n')
            for i, label in enumerate(label_of(np.arange(n))):
                value = "" if i % 11 == 0 else " %g " % (i / 4)
                f.write('%d,"item %d, ""%s""",%s,%d\r\n' % (i, i, "ab"[i % 2], value, label))
                if i % 97 == 0:
                    f.write("\r\n  \r\n")
    return write


def test_csv_quotes_blank_lines_crlf_and_empty_fields(shared):
    n = 4001
    path = written(shared / "messy.csv", messy_csv_writer(n))
    ds = DataSet(path, features=["id", "value"], labels="label", per_rank_batch_size=B,
                 shuffle=False, memory_budget=4 << 20)
    check_epochs(ds, list(range(n)))
    x = ds.training_data
    ids = x[:, 0].astype(np.int64)
    expected = np.where(ids % 11 == 0, np.nan, ids / 4).astype(np.float32)
    assert np.array_equal(x[:, 1], expected, equal_nan=True)
    assert np.array_equal(ds.training_labels, label_of(ids))


def test_csv_label_by_index_and_default_features(shared):
    path = written(shared / "header.csv", csv_writer(5003, True))
    ds = DataSet(path, features=None, labels=-1, per_rank_batch_size=B)
    x, y = next(iter(ds.train))
    assert x.shape == (B, 3) and y.shape == (B,)
    assert np.array_equal(y.numpy(), label_of(x.numpy()[:, 0]))


@pytest.mark.parametrize("fmt", ["NETCDF3_CLASSIC", "NETCDF3_64BIT_OFFSET", "NETCDF3_64BIT_DATA",
                                 "NETCDF4"])
@pytest.mark.parametrize("dim", ["fixed", "unlimited"])
def test_netcdf_written_by_netcdf4(shared, fmt, dim):
    n = 509
    path = written(shared / ("%s-%s.nc" % (fmt, dim)), nc_writer(n, fmt, dim == "unlimited"))
    ds = DataSet(path, features=None, per_rank_batch_size=B, validation_split=0.1)
    assert ds.training_data.shape[1:] == (FEATURES,)    # coordinate 'sample', 'other' left out
    check_epochs(ds, *split_ids(n, 0.1))


@pytest.mark.parametrize("version", [1, 2, 5])
@pytest.mark.parametrize("dim", ["fixed", "unlimited"])
def test_netcdf_written_pnetcdf_style(shared, version, dim):
    n = 487
    path = written(shared / ("pnetcdf-%d-%s.nc" % (version, dim)),
                   cdf_writer(n, version, dim == "unlimited"))
    with netCDF4.Dataset(path) as d:                      # the file is valid netCDF
        assert np.array_equal(d["x"][:], samples(n))
    ds = DataSet(path, per_rank_batch_size=B)
    assert ds.training_labels.dtype == np.int64
    check_epochs(ds, list(range(n)))


@pytest.mark.parametrize("how", ["list", "directory", "glob"])
def test_several_files_are_one_dataset(shared, how):
    sizes = [130, 77, 241]
    folder = shared / "parts"
    if R == 0:
        folder.mkdir(exist_ok=True)
    matex.comm().Barrier()
    starts = np.cumsum([0] + sizes)
    paths = [written(folder / ("part%d.h5" % i), h5_writer(s, int(starts[i]),
                                                          chunks=(16, 3) if i == 1 else None))
             for i, s in enumerate(sizes)]
    source = {"list": paths, "directory": str(folder), "glob": str(folder / "part*.h5")}[how]
    ds = DataSet(source, per_rank_batch_size=B, validation_split=0.1)
    assert ds.paths == paths
    check_epochs(ds, *split_ids(sum(sizes), 0.1))


def test_several_csv_files(shared):
    folder = shared / "csvparts"
    if R == 0:
        folder.mkdir(exist_ok=True)
    matex.comm().Barrier()
    paths = [written(folder / ("p%d.csv" % i), csv_writer(700, True, 700 * i)) for i in range(3)]
    ds = DataSet(str(folder / "*.csv"), features=["id"], labels="label", per_rank_batch_size=B,
                 shuffle=False)
    assert ds.num_samples == 2100 and ds.paths == paths
    ids = np.concatenate(matex.comm().allgather(ds.training_data[:, 0]))
    assert np.array_equal(ids, np.arange(ds.steps_per_epoch * B * N))
    check_epochs(ds, list(range(2100)))


def test_sample_shapes_and_several_fields(shared):
    n = 300

    def write(path):
        with h5py.File(path, "w") as f:
            f["image"] = np.arange(n * 16, dtype=np.uint16).reshape(n, 4, 4)
            f["scalar"] = np.arange(n, dtype=np.float64)
            f["y"] = np.arange(n, dtype=np.int32)
            f["z"] = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    path = written(shared / "shapes.h5", write)
    image = DataSet(path, features="image", per_rank_batch_size=B)
    x, y = next(iter(image.train))
    assert x.shape == (B, 4, 4) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x.numpy()[:, 0, 0] / 16, y.numpy())
    joined = DataSet(path, features=["scalar", "image"], labels=["y", "z"], per_rank_batch_size=B)
    x, y = (t.numpy() for t in next(iter(joined.train)))
    assert x.shape == (B, 17) and y.shape == (B, 3) and y.dtype == np.float32
    assert np.array_equal(x[:, 0], y[:, 0]) and np.array_equal(x[:, 1], 16 * x[:, 0])
    single = DataSet(path, features="scalar", labels="z", per_rank_batch_size=B)
    assert single.training_data.shape == (single.steps_per_epoch * B, 1)
    default = DataSet(path, features=None, labels="y", per_rank_batch_size=B)
    assert default.training_data.shape[1:] == (16 + 1 + 2,)


def test_unlabeled(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, labels=None, per_rank_batch_size=B)
    batch = next(iter(ds.train))
    assert not isinstance(batch, tuple) and batch.shape == (B, FEATURES)
    assert ds.training_labels is None


def test_datasets_are_marked_sharded(shared):
    import tensorflow as tf

    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, per_rank_batch_size=B, validation_split=0.1)
    assert _batch_slicing.is_sharded(ds.train) and _batch_slicing.is_sharded(ds.validation)
    assert int(ds.train.cardinality()) == ds.steps_per_epoch
    assert int(ds.validation.cardinality()) == ds.validation_steps
    # the mark survives transformations, so fit (matex.shard) never slices them again
    chained = ds.train.map(lambda x, y: (x * 1.0, y)).cache().take(3).repeat(2).prefetch(1)
    assert _batch_slicing.is_sharded(chained) and matex.shard(chained) is chained
    ids = [b[0].numpy()[:, 0] for b in chained]
    assert [len(i) for i in ids] == [B] * 6               # this rank's batches, uncut
    everyone = np.concatenate(matex.comm().allgather(np.concatenate(ids[:3])))
    assert len(np.unique(everyone)) == 3 * B * N
    assert not _batch_slicing.is_sharded(tf.data.Dataset.range(3))


# ---- batch size: global, or per rank --------------------------------------------

def test_batch_size_is_the_global_batch(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, batch_size=B * N, validation_split=0.1)
    assert (ds.batch_size, ds.per_rank_batch_size) == (B * N, B)
    assert ds.steps_per_epoch == ds.num_samples // (B * N)
    check_epochs(ds, *split_ids(611, 0.1))
    assert {len(b[0]) for b in batches_of(ds.train)} == {B}
    per_rank = DataSet(path, per_rank_batch_size=B, validation_split=0.1)
    assert (per_rank.batch_size, per_rank.per_rank_batch_size) == (B * N, B)
    assert per_rank.steps_per_epoch == ds.steps_per_epoch
    default = DataSet(path)                               # neither: 32 per rank
    assert (default.batch_size, default.per_rank_batch_size) == (32 * N, 32)


def test_batch_size_that_ranks_do_not_divide(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    if N > 1:
        expect_error(shared, lambda: DataSet(path, batch_size=B * N + 1),
                     "batch_size=%d" % (B * N + 1), "GLOBAL batch", "%d ranks" % N,
                     "per_rank_batch_size")
    expect_error(shared, lambda: DataSet(path, batch_size=B * N, per_rank_batch_size=B),
                 "not both")
    expect_error(shared, lambda: DataSet(path, batch_size=0), "batch_size", "positive")
    expect_error(shared, lambda: DataSet(path, per_rank_batch_size=2.5), "per_rank_batch_size")
    if N > 1:
        expect_error(shared, lambda: DataSet(path, per_rank_batch_size=B + R), "ranks disagree")


def test_one_time_note_on_rank_0_when_batch_size_is_given(shared, capsys):
    path = written(shared / "contiguous.h5", h5_writer(611))
    _dataset._now.noted = False
    capsys.readouterr()
    DataSet(path, per_rank_batch_size=B).close()
    DataSet(path).close()
    quiet = capsys.readouterr()
    DataSet(path, batch_size=B * N).close()
    DataSet(path, batch_size=B * N).close()
    noted = capsys.readouterr()
    assert "matex.readers" not in quiet.err + quiet.out
    notes = noted.err.count("is the GLOBAL batch")
    assert notes == (1 if R == 0 and N > 1 else 0), noted.err
    if notes:
        assert "per_rank_batch_size=%d" % (B * N) in noted.err
        assert "%d samples per rank on %d ranks" % (B, N) in noted.err


def test_training_data_is_this_ranks_shard(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, per_rank_batch_size=B)
    x, y = ds.training_data, ds.training_labels
    share = ds.steps_per_epoch * B
    assert np.array_equal(x[:, 0], np.arange(R * share, (R + 1) * share))
    assert np.array_equal(y, label_of(x[:, 0]))


# ---- bad input ------------------------------------------------------------------

def expect_error(shared, make, *needles):
    """``make()`` raises ReaderError on every rank: one message naming each needle; no new file."""
    listing = sorted(p.name for p in shared.rglob("*"))
    try:
        make()
        message = None
    except ReaderError as exc:
        message = str(exc)
    everyone = matex.comm().allgather(message)
    unchanged = matex.comm().allgather(listing == sorted(p.name for p in shared.rglob("*")))
    assert None not in everyone, everyone
    assert len(set(everyone)) == 1, everyone
    for needle in needles:
        assert needle in everyone[0], (needle, everyone[0])
    assert all(unchanged)


def truncated(source, fraction):
    def write(path):
        with open(source, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:int(len(data) * fraction)])
    return write


def cut_csv(source):
    """``source`` cut in the middle of a line, inside its second field."""
    def write(path):
        data = open(source, "rb").read()
        line = data.index(b"\n", int(len(data) * 0.77)) + 1
        with open(path, "wb") as f:
            f.write(data[:data.index(b",", line) + 2])
    return write


def bad_csv(row, value=None):
    """A CSV with data row ``row`` broken: one field replaced by ``value``, or one dropped."""
    def write(path):
        csv_writer(5003, True)(path)
        lines = open(path).read().split("\n")
        fields = lines[row].split(",")
        lines[row] = ",".join(fields[:2] + [value]) + "," + fields[3] if value else \
            ",".join(fields[:3])
        open(path, "w").write("\n".join(lines))
    return write


def different_lengths(path):
    with h5py.File(path, "w") as f:
        f["x"] = samples(100)
        f["y"] = label_of(np.arange(99))


def test_missing_file(shared):
    expect_error(shared, lambda: DataSet(str(shared / "nope.h5")), "nope.h5", "no such file")
    expect_error(shared, lambda: DataSet(str(shared / "nothing*.h5")), "no file matches")
    expect_error(shared, lambda: DataSet([written(shared / "contiguous.h5", h5_writer(611)),
                                          str(shared / "gone.h5")]), "gone.h5")


def test_missing_fields(shared):
    h5 = written(shared / "contiguous.h5", h5_writer(611))
    nc = written(shared / "NETCDF3_CLASSIC-fixed.nc", nc_writer(509, "NETCDF3_CLASSIC", False))
    csv = written(shared / "header.csv", csv_writer(5003, True))
    expect_error(shared, lambda: DataSet(h5, features="z"), "contiguous.h5", "dataset 'z'")
    expect_error(shared, lambda: DataSet(h5, labels="w"), "dataset 'w'")
    expect_error(shared, lambda: DataSet(nc, features="temp"), "variable 'temp'")
    expect_error(shared, lambda: DataSet(csv, features=["id", "nope"], labels="label"),
                 "header.csv", "column 'nope'")
    expect_error(shared, lambda: DataSet(csv, features=[0], labels=9), "no column 9")
    expect_error(shared, lambda: DataSet(h5, format="hdf5-classes", features=["x", "q"]),
                 "dataset 'q'")


def test_features_and_labels_of_different_lengths(shared):
    path = written(shared / "lengths.h5", different_lengths)
    expect_error(shared, lambda: DataSet(path), "lengths.h5", "'x' has 100", "'y' has 99")


def test_truncated_and_corrupt_files(shared):
    h5 = written(shared / "contiguous.h5", h5_writer(611))
    short_h5 = written(shared / "short.h5", truncated(h5, 0.6))
    junk = written(shared / "junk.h5", lambda p: p.write_bytes(os.urandom(4096)))
    nc = written(shared / "NETCDF3_64BIT_DATA-unlimited.nc",
                 nc_writer(509, "NETCDF3_64BIT_DATA", True))
    short_nc = written(shared / "short.nc", truncated(nc, 0.7))
    tiny_nc = written(shared / "tiny.nc", truncated(nc, 0.01))
    csv = written(shared / "header.csv", csv_writer(5003, True))
    short_csv = written(shared / "short.csv", cut_csv(csv))
    expect_error(shared, lambda: DataSet(short_h5), "short.h5")
    expect_error(shared, lambda: DataSet(junk), "junk.h5", "cannot read as HDF5")
    expect_error(shared, lambda: DataSet(short_nc), "short.nc", "truncated")
    expect_error(shared, lambda: DataSet(tiny_nc), "tiny.nc")
    expect_error(shared, lambda: DataSet(short_csv, labels="label", features=None),
                 "short.csv", "fields, expected 4")


def test_non_numeric_csv_field_names_row_and_column(shared):
    # the bad row lies in the last rank's byte range: only that rank can see it
    path = written(shared / "bad-field.csv", bad_csv(4900, "abc"))
    expect_error(shared, lambda: DataSet(path, labels="label", features=None),
                 "bad-field.csv", "line 4901", "data row 4900", "column 'mod7'", "'abc'")
    short = written(shared / "bad-row.csv", bad_csv(17))
    expect_error(shared, lambda: DataSet(short, labels="label", features=None),
                 "bad-row.csv", "line 18", "has 3 fields, expected 4")


def test_too_few_samples(shared):
    path = written(shared / ("few-%d.h5" % N), h5_writer(4 * N - 1))
    expect_error(shared, lambda: DataSet(path, per_rank_batch_size=4),
                 "fewer than one global batch")
    expect_error(shared, lambda: DataSet(path, per_rank_batch_size=1, validation_split=0.1),
                 "validation samples are fewer than the %d ranks" % N)


def test_files_whose_shapes_disagree(shared):
    a = written(shared / "shape3.h5", h5_writer(50))
    b = written(shared / "shape4.h5", h5_writer(50, features=4))
    expect_error(shared, lambda: DataSet([a, b], per_rank_batch_size=1), "shape3.h5", "shape4.h5",
                 "shape of 'x'")
    c = written(shared / "cols1.csv", csv_writer(50, True))
    d = written(shared / "cols2.csv", csv_writer(50, True, names="id,double,mod7,other"))
    expect_error(shared, lambda: DataSet([c, d], features=None, labels=None,
                                         per_rank_batch_size=1),
                 "cols1.csv", "cols2.csv", "different columns")


def test_memory_budget_too_small(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    expect_error(shared, lambda: DataSet(path, memory_budget=1000), "too small")
    expect_error(shared, lambda: DataSet(path, memory_budget="lots"), "not a size")


# ---- re-sharding ----------------------------------------------------------------

def test_reshard_after_losing_a_rank(shared):
    n, k = 653, 3
    path = written(shared / "reshard.h5", h5_writer(n))
    ds = DataSet(path, per_rank_batch_size=B, seed=11)
    steps_before = ds.steps_per_epoch
    iterator = iter(ds.train)
    before = [next(iterator)[0].numpy()[:, 0] for _ in range(k)]
    del iterator
    survivors = max(N - 1, 1)
    alive = R < survivors
    after, rest_steps, next_steps, length, error = [], None, None, None, None
    with SubCommunicator(lambda rank: 0 if rank < survivors else 1):
        if alive:
            try:
                rest_steps = ds.reshard(k)
                length = int(ds.train.cardinality())
                after = [b[0].numpy()[:, 0] for b in ds.train]
                next_steps = (len(list(ds.train)), ds.steps_per_epoch)
            except Exception as exc:     # noqa: BLE001 - reported after every rank is back
                error = repr(exc)
    everyone = matex.comm().allgather((before, after, rest_steps, next_steps, error))
    assert [e[4] for e in everyone] == [None] * N
    assert length == rest_steps
    seen_before = np.concatenate([np.concatenate(e[0]) for e in everyone])
    seen_after = np.concatenate([np.concatenate(e[1]) if e[1] else np.zeros(0)
                                 for e in everyone[:survivors]])
    both = np.concatenate([seen_before, seen_after])
    assert len(seen_before) == k * B * N
    assert {e[2] for e in everyone[:survivors]} == {len(everyone[0][1])}
    assert all(len(e[1]) == everyone[0][2] for e in everyone[:survivors])
    assert len(np.unique(both)) == len(both), "a sample was read twice"
    assert set(both.tolist()) <= set(range(n))
    left_out = n - len(both)
    assert 0 <= left_out < B * survivors
    assert everyone[0][2] == (n - k * B * N) // (B * survivors)
    assert everyone[0][3] == (n // (B * survivors),) * 2       # next epoch: whole again
    assert steps_before == n // (B * N)


def test_reshard_arguments_are_checked(shared):
    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, per_rank_batch_size=B)
    assert ds.reshard(0) == ds.steps_per_epoch                # before any epoch: nothing to do
    with pytest.raises(ReaderError, match="no epoch"):
        ds.reshard(1)
    list(ds.train)
    with pytest.raises(ReaderError, match="consumed_steps"):
        ds.reshard(ds.steps_per_epoch + 1)
    if N > 1:
        with pytest.raises(ReaderError, match="disagree"):
            ds.reshard(R)


# ---- Keras ----------------------------------------------------------------------

def test_keras_fit_runs_steps_per_epoch(shared):
    import keras

    path = written(shared / "contiguous.h5", h5_writer(611))
    ds = DataSet(path, per_rank_batch_size=B, validation_split=0.2)

    class Count(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches, self.epochs = 0, []

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append((self.batches, "val_loss" in logs))
            self.batches = 0

    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(11)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    count = Count()
    model.fit(ds.train, validation_data=ds.validation, epochs=2, verbose=0, callbacks=[count],
              shuffle=False)     # the DataSet shuffles; Keras cannot shuffle a tf.data stream
    assert count.epochs == [(ds.steps_per_epoch, True)] * 2
    assert ds.epoch == 2
