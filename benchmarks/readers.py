"""matex.readers.DataSet throughput and memory vs the plain ways of reading the same files.

    python benchmarks/readers.py            # full run: files of about 512 MB each
    python benchmarks/readers.py --quick    # smoke run: files of about 16 MB

The driver writes the files (HDF5 contiguous and chunked+gzip, CSV, netCDF
CDF-5) into $MATEX_BENCH_DIR (kept) or a temporary directory (removed),
then runs the worker phases under mpiexec: ``ranks1`` and ``ranks2`` measure,
on 1 and 2 ranks, one shuffled epoch of ``DataSet.train`` consumed in a
``tf.function`` loop (as ``model.fit`` consumes it) against h5py reads of the
same batches sample by sample and by fancy indexing, ``pandas.read_csv`` of
the whole file and netCDF4 whole-variable reads; ``memory`` measures the peak
anonymous memory of an epoch with a budget of half the data (decoded size).
Figures are per rank, the slowest rank's. Page cache is warm for every method.
The CPU reference rows show how much CPU a rank gets with 2 ranks running
(on a machine with 2 free cores, close to 1.00 of the 1-rank figure).

Targets (from the issue): HDF5 contiguous shuffled batches >= 10x h5py fancy
indexing; CSV MB/s per rank (2 ranks) >= pandas' single-process MB/s, where a
rank's CSV rate is that of parsing its own byte range when the DataSet opens
(the first shuffled epoch also parses the blocks other ranks parsed when
opening, and is shown too); peak memory within the budget on a file twice
its size. The readers' native CSV parser is built (once) before anything is
timed; without a compiler the CSV figures are pandas'.
"""

import os
import shutil
import sys
import tempfile
import time

import _common

WORKERS = ["ranks1", "ranks2", "memory"]
COLUMNS = 64
BATCH = 256          # per rank (DataSet per_rank_batch_size)


def sizes(quick):
    """Rows of the HDF5/netCDF files and bytes of the CSV file."""
    return (1 << 16, 16 << 20) if quick else (1 << 21, 512 << 20)


# ---- files ----------------------------------------------------------------------

def write_files(folder, quick):
    """The benchmark's files in ``folder``; returns their paths by kind."""
    import h5py
    import netCDF4
    import numpy as np

    rows, csv_bytes = sizes(quick)
    slab = 1 << 16
    paths = bench_files(folder)

    def features(start, stop):
        x = np.random.default_rng(start).random((stop - start, COLUMNS), dtype=np.float32)
        x[:, 0] = np.arange(start, stop)
        return x

    with h5py.File(paths["hdf5"], "w") as f, h5py.File(paths["chunked"], "w") as g:
        x = f.create_dataset("x", (rows, COLUMNS), np.float32)
        y = f.create_dataset("y", (rows,), np.int64)
        cx = g.create_dataset("x", (rows, COLUMNS), np.float32, chunks=(1024, COLUMNS),
                              compression="gzip", compression_opts=1)
        cy = g.create_dataset("y", (rows,), np.int64)
        for start in range(0, rows, slab):
            stop = min(start + slab, rows)
            x[start:stop] = cx[start:stop] = features(start, stop)
            y[start:stop] = cy[start:stop] = np.arange(start, stop) % 10
    with netCDF4.Dataset(paths["netcdf"], "w", format="NETCDF3_64BIT_DATA") as d:
        d.createDimension("sample", rows)
        d.createDimension("feature", COLUMNS)
        x = d.createVariable("x", "f4", ("sample", "feature"))
        y = d.createVariable("y", "i8", ("sample",))
        for start in range(0, rows, slab):
            stop = min(start + slab, rows)
            x[start:stop] = features(start, stop)
            y[start:stop] = np.arange(start, stop) % 10
    block_rows = features(0, 10000)[:, :24].round(3)
    header = ",".join("f%d" % i for i in range(24)) + ",label\n"
    lines = "".join(",".join("%g" % v for v in row) + ",%d\n" % (i % 10)
                    for i, row in enumerate(block_rows))
    with open(paths["csv"], "w") as f:
        f.write(header)
        for _ in range(max(1, csv_bytes // len(lines))):
            f.write(lines)
    return paths


# ---- worker side ----------------------------------------------------------------

def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def train_epoch(drain, path, **options):
    """(samples/s, seconds to open) of one shuffled epoch of DataSet.train."""
    from matex.readers import DataSet

    ds, opened = timed(lambda: DataSet(path, per_rank_batch_size=BATCH, validation_split=0.01,
                                       **options))
    drain(ds.validation)                                 # traces drain, warms the pipeline
    seen, seconds = timed(lambda: int(drain(ds.train)))
    assert seen == ds.steps_per_epoch * BATCH
    plan = ds._train_plan(ds.epoch)
    ds.close()
    return seen / seconds, opened, plan


def h5py_baselines(path, plan, rank, budget_seconds):
    """samples/s of h5py reading this rank's batches sample by sample, and by fancy indexing."""
    import h5py
    import numpy as np

    batches = [rows for rows, _ in plan.groups(rank, 1)]
    with h5py.File(path, "r") as f:
        x, y = f["x"], f["y"]

        def per_sample():
            done, start = 0, time.perf_counter()
            for rows in batches:
                for i in np.sort(rows):
                    x[i], y[i]
                done += len(rows)
                if time.perf_counter() - start > budget_seconds:
                    break
            return done / (time.perf_counter() - start)

        def fancy():
            done, start = 0, time.perf_counter()
            for rows in batches:
                rows = np.sort(rows)
                x[rows], y[rows]
                done += len(rows)
                if time.perf_counter() - start > budget_seconds:
                    break
            return done / (time.perf_counter() - start)

        return per_sample(), fancy()


def worker_ranks(args):
    """DataSet vs h5py, pandas and netCDF4 on this phase's ranks."""
    import netCDF4
    import pandas as pd

    import matex

    from matex.readers import _csv

    comm, rank = matex.comm(), matex.rank()
    _csv.native()       # the native CSV parser is compiled on first use: not while timed
    drain = _common.drain_function()
    budget_seconds = 1.0 if args.quick else 5.0
    comm.Barrier()
    result = {"cpu": {"loops": cpu_speed()}}

    rate, _, plan = train_epoch(drain, args.files["hdf5"], features="x", labels="y")
    naive, fancy = h5py_baselines(args.files["hdf5"], plan, rank, budget_seconds)
    result["hdf5"] = {"dataset": rate, "fancy": fancy, "per_sample": naive}

    csv_bytes = os.path.getsize(args.files["csv"])
    row_bytes = csv_bytes / _csv_rows(args.files["csv"], comm)
    rate, opened, _ = train_epoch(drain, args.files["csv"], features=None, labels="label")
    result["csv"] = {"epoch_mbps": rate * row_bytes / 2**20,
                     "open_mbps": csv_bytes / matex.size() / opened / 2**20}
    comm.Barrier()
    _, seconds = timed(lambda: pd.read_csv(args.files["csv"]))
    result["csv"]["pandas_mbps"] = csv_bytes / seconds / 2**20

    rate, _, _ = train_epoch(drain, args.files["netcdf"], features="x", labels="y")
    with netCDF4.Dataset(args.files["netcdf"]) as d:
        d.set_auto_mask(False)
        _, seconds = timed(lambda: (d.variables["x"][:], d.variables["y"][:]))
        rows = d.dimensions["sample"].size
    result["netcdf"] = {"dataset": rate, "netcdf4": rows / seconds}
    _common.emit(_common.worst_over_ranks(comm, result, pick=min), rank)


def cpu_speed(seconds=0.3):
    """Iterations per second of a plain Python loop: how much CPU this rank gets."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10000):
            count += 1
    return count / (time.perf_counter() - start)


def _csv_rows(path, comm):
    """Data rows of the CSV file (counted once, on rank 0)."""
    if comm.Get_rank() == 0:
        with open(path, "rb") as f:
            rows = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b"")) - 1
    return comm.bcast(rows if comm.Get_rank() == 0 else None, root=0)


def worker_memory(args):
    """Peak anonymous memory of one epoch with a budget of half the data."""
    import gc
    import threading

    from matex.readers import DataSet

    def anonymous():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    from matex.readers import _csv

    _csv.native()
    drain = _common.drain_function()
    result = {}
    for kind, options in (("hdf5", dict(features="x", labels="y")),
                          ("chunked", dict(features="x", labels="y")),
                          ("csv", dict(features=None, labels="label"))):
        path = args.files[kind]
        data = os.path.getsize(path) if kind == "csv" else sizes(args.quick)[0] * (COLUMNS * 4 + 8)
        budget = data // 2
        warm = DataSet(path, per_rank_batch_size=BATCH, validation_split=0.01,
                       memory_budget=budget, **options)
        drain(warm.validation)
        warm.close()
        del warm
        gc.collect()
        base = peak = anonymous()
        stop = threading.Event()

        def sample():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, anonymous())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        ds = DataSet(path, per_rank_batch_size=BATCH, memory_budget=budget, **options)
        _, seconds = timed(lambda: int(drain(ds.train)))
        ds.close()
        stop.set()
        sampler.join()
        peak = max(peak, anonymous())
        result[kind] = {"peak_mb": (peak - base) / 2**20, "budget_mb": budget / 2**20,
                        "data_mb": data / 2**20, "seconds": seconds}
    _common.emit(result)


# ---- driver side ----------------------------------------------------------------

def report(results, command):
    """The Markdown tables and target lines of the merged phase results."""
    one, two, memory = results["ranks1"], results["ranks2"], results["memory"]
    row_mb = COLUMNS * 4 / 2**20
    rows = [["CPU reference", ranks, "plain Python loop (iterations/s)",
             "%.0f" % res["cpu"]["loops"], "-",
             "%.2f" % (res["cpu"]["loops"] / one["cpu"]["loops"])]
            for ranks, res in (("1", one), ("2", two))]
    for ranks, res in (("1", one), ("2", two)):
        h = res["hdf5"]
        rows += [
            ["HDF5 contiguous", ranks, "DataSet.train (shuffled)", "%.0f" % h["dataset"],
             "%.1f" % (h["dataset"] * row_mb), "%.2f" % (h["dataset"] / h["fancy"])],
            ["HDF5 contiguous", ranks, "h5py fancy index per batch", "%.0f" % h["fancy"],
             "%.1f" % (h["fancy"] * row_mb), "1.00"],
            ["HDF5 contiguous", ranks, "h5py per sample", "%.0f" % h["per_sample"],
             "%.1f" % (h["per_sample"] * row_mb), "%.2f" % (h["per_sample"] / h["fancy"])],
        ]
    pandas = one["csv"]["pandas_mbps"]
    for ranks, res in (("1", one), ("2", two)):
        c = res["csv"]
        rows += [
            ["CSV", ranks, "DataSet.train first epoch", "-", "%.1f" % c["epoch_mbps"],
             "%.2f" % (c["epoch_mbps"] / pandas)],
            ["CSV", ranks, "DataSet open (parses own range)", "-", "%.1f" % c["open_mbps"],
             "%.2f" % (c["open_mbps"] / pandas)],
        ]
    rows.append(["CSV", "1", "pandas.read_csv whole file", "-", "%.1f" % pandas, "1.00"])
    for ranks, res in (("1", one), ("2", two)):
        n = res["netcdf"]
        rows += [
            ["netCDF CDF-5", ranks, "DataSet.train (shuffled)", "%.0f" % n["dataset"],
             "%.1f" % (n["dataset"] * row_mb), "%.2f" % (n["dataset"] / n["netcdf4"])],
            ["netCDF CDF-5", ranks, "netCDF4 whole variable", "%.0f" % n["netcdf4"],
             "%.1f" % (n["netcdf4"] * row_mb), "1.00"],
        ]
    table = _common.table(["file", "ranks", "reader", "samples/s per rank", "MB/s per rank",
                           "ratio"], rows)
    memory_rows = [[kind, "%.0f" % m["data_mb"], "%.0f" % m["budget_mb"], "%.1f" % m["peak_mb"],
                    "%.2f" % (m["peak_mb"] / m["budget_mb"])] for kind, m in memory.items()]
    memory_table = _common.table(["file (1 rank, budget = data / 2)", "data MB", "budget MB",
                                  "peak extra MB", "peak / budget"], memory_rows)
    ratio = one["hdf5"]["dataset"] / one["hdf5"]["fancy"]
    csv_two = two["csv"]["open_mbps"]
    worst = max(m["peak_mb"] / m["budget_mb"] for m in memory.values())
    targets = [
        _common.target("HDF5 contiguous shuffled DataSet >= 10x h5py fancy indexing (1 rank)",
                       ratio >= 10, "%.1fx" % ratio),
        _common.target("CSV parsing MB/s per rank (2 ranks, each its own byte range) >= "
                       "pandas single-process MB/s", csv_two >= pandas,
                       "%.0f vs %.0f MB/s" % (csv_two, pandas)),
        _common.target("peak memory within the budget on files 2x the budget",
                       worst <= 1.0, "worst peak / budget %.2f" % worst),
    ]
    return "\n".join([_common.header("matex.readers.DataSet", command), table, "",
                      memory_table, "", "Targets:", ""] + targets)


def bench_files(folder):
    """Paths of the benchmark's files in ``folder``, by kind."""
    return {k: os.path.join(folder, n) for k, n in (
        ("hdf5", "contiguous.h5"), ("chunked", "chunked.h5"), ("csv", "data.csv"),
        ("netcdf", "data.nc"))}


def main():
    args = _common.parse_args(__doc__.splitlines()[0], WORKERS, repeats=1)
    if args.worker:
        args.files = bench_files(os.environ["MATEX_BENCH_DIR"])
        {"ranks1": worker_ranks, "ranks2": worker_ranks, "memory": worker_memory}[
            args.worker](args)
        return
    kept = os.environ.get("MATEX_BENCH_DIR")
    folder = kept or tempfile.mkdtemp(prefix="matex-readers-")
    try:
        started = time.perf_counter()
        write_files(folder, args.quick)
        print("wrote the files in %.1f s" % (time.perf_counter() - started), file=sys.stderr)
        os.environ["MATEX_BENCH_DIR"] = folder
        flags = ["--quick"] if args.quick else []
        phases = {"ranks1": dict(nranks=1, args=flags), "ranks2": dict(nranks=2, args=flags),
                  "memory": dict(nranks=1, args=flags)}
        results = _common.run_phases(__file__, phases, args.repeats)
    finally:
        if not kept:
            shutil.rmtree(folder, ignore_errors=True)
    command = "python benchmarks/readers.py" + (" --quick" if args.quick else "")
    print(report(results, command))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
