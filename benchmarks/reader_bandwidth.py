"""matex.readers.DataSet against NumPy's in-memory gather of the same shuffled batches.

    python benchmarks/reader_bandwidth.py            # full run: 100 k samples per file
    python benchmarks/reader_bandwidth.py --quick    # smoke run: 8 k samples

The driver writes two contiguous HDF5 files (float32 rows of 64 and of 1,024
values, int64 labels) into $MATEX_BENCH_DIR (kept) or a temporary directory
(removed) and runs one worker on 1 rank. For each file, with its pages in
the page cache, the worker measures, round-robin (median of the rounds):

- NumPy: fancy indexing of the same shuffled batches (``x[rows]``,
  ``y[rows]``) from the whole file loaded into an in-memory array: the
  reference every ratio is taken against;
- ``DataSet.train`` (per-rank batch 256, shuffled) drained in a
  ``tf.function`` loop, and consumed by ``model.fit`` with a trivial model
  (one Dense unit, ``steps_per_execution`` 16, the first execution excluded);
- the same through the previous path (each batch gathered in a
  ``numpy_function``), for a before/after in the same run;
- the floor of both: a bare tf.data pipeline over the same batches already
  built as tensors (``from_tensor_slices``), drained and fit the same way;
- h5py fancy indexing of the same batches (rows sorted, as h5py requires).

Targets (from the issue): DataSet.train >= 50 % of NumPy's gather rate for
64- and 1,024-float rows, drained and in fit; >= 10x h5py fancy indexing on
the wide rows.
"""

import os
import shutil
import sys
import tempfile
import time

import _common

WORKERS = ["bandwidth"]
WIDTHS = (64, 1024)
BATCH = 256                 # per rank
STEPS_PER_EXECUTION = 16


def rows_of(quick):
    return 8192 if quick else 100_000


def file_path(folder, width):
    return os.path.join(folder, "rows%d.h5" % width)


def write_files(folder, quick):
    import h5py
    import numpy as np

    rows = rows_of(quick)
    for width in WIDTHS:
        with h5py.File(file_path(folder, width), "w") as f:
            x = f.create_dataset("x", (rows, width), np.float32)
            for start in range(0, rows, 8192):
                stop = min(start + 8192, rows)
                x[start:stop] = np.random.default_rng(start).random((stop - start, width),
                                                                    dtype=np.float32)
            f["y"] = np.arange(rows, dtype=np.int64) % 10


# ---- worker side ----------------------------------------------------------------

def fit_rate(keras, model, dataset, steps):
    """samples/s of one ``model.fit`` epoch over ``dataset``, its first execution excluded."""
    marks = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.append((batch, time.perf_counter()))

    model.fit(dataset, epochs=1, verbose=0, callbacks=[Clock()], shuffle=False)
    (first, start), (_, stop) = marks[0], marks[-1]
    assert len(marks) == -(-steps // STEPS_PER_EXECUTION), (len(marks), steps)
    return (steps - (first + 1)) * BATCH / (stop - start)   # batch numbers count from 0


def measure_width(path, rounds, quick):
    import h5py
    import keras
    import numpy as np
    import tensorflow as tf

    from matex.readers import DataSet, _gather

    with h5py.File(path, "r") as f:
        x_all, y_all = f["x"][:], f["y"][:]
    width = x_all.shape[1]
    ds = DataSet(path, features="x", labels="y", per_rank_batch_size=BATCH)
    _gather.NATIVE = False
    try:
        previous = DataSet(path, features="x", labels="y", per_rank_batch_size=BATCH)
    finally:
        _gather.NATIVE = True
    assert ds._gatherer.native and not previous._gatherer.native
    steps = ds.steps_per_epoch
    batches = [rows for rows, _ in ds._train_plan(0).groups(0, 1)]
    assert len(batches) == steps
    train = ds.train
    built_x = tf.constant(np.stack([x_all[rows] for rows in batches]))
    built_y = tf.constant(np.stack([y_all[rows] for rows in batches]))
    floor = tf.data.Dataset.from_tensor_slices((built_x, built_y))
    drain = _common.drain_function()
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-6), "mse", steps_per_execution=STEPS_PER_EXECUTION)
    samples = steps * BATCH
    budget = 0.5 if quick else 2.0

    def numpy_gather():
        start = time.perf_counter()
        for rows in batches:
            x_all[rows], y_all[rows]
        return samples / (time.perf_counter() - start)

    def drained(dataset):
        def run():
            start = time.perf_counter()
            seen = int(drain(dataset))
            seconds = time.perf_counter() - start
            assert seen == samples, (seen, samples)
            return samples / seconds
        return run

    def h5py_fancy():
        with h5py.File(path, "r") as f:
            x, y = f["x"], f["y"]
            done, start = 0, time.perf_counter()
            for rows in batches:
                rows = np.sort(rows)
                x[rows], y[rows]
                done += len(rows)
                if time.perf_counter() - start > budget:
                    break
            return done / (time.perf_counter() - start)

    variants = {
        "numpy": numpy_gather,
        "dataset": drained(train),
        "floor": drained(floor),
        "previous": drained(previous.train),
        "dataset_fit": lambda: fit_rate(keras, model, train, steps),
        "previous_fit": lambda: fit_rate(keras, model, previous.train, steps),
        "floor_fit": lambda: fit_rate(keras, model, floor, steps),
        "h5py_fancy": h5py_fancy,
    }
    result = _common.interleave(variants, rounds)
    ds.close()
    previous.close()
    return result


def worker_bandwidth(args):
    import matex

    folder = os.environ["MATEX_BENCH_DIR"]
    rounds = 2 if args.quick else 5
    result = {str(width): measure_width(file_path(folder, width), rounds, args.quick)
              for width in WIDTHS}
    _common.emit(result, matex.rank())


# ---- driver side ----------------------------------------------------------------

ROWS = [("numpy", "NumPy fancy index of an in-memory array"),
        ("dataset", "DataSet.train drained in a tf.function"),
        ("previous", "previous path (numpy_function gather), drained"),
        ("floor", "floor: tf.data over pre-built batches, drained"),
        ("dataset_fit", "DataSet.train in fit (Dense(1))"),
        ("previous_fit", "previous path in fit"),
        ("floor_fit", "floor: pre-built batches in fit"),
        ("h5py_fancy", "h5py fancy index (sorted rows)")]


def report(results, command):
    rows = []
    for width in WIDTHS:
        res = results["bandwidth"][str(width)]
        for key, label in ROWS:
            rate = res[key]
            rows.append([str(width), label, "%.0f" % (rate / 1e3),
                         "%.2f" % (rate * (4 * width + 8) / 1e9),
                         "%.2f" % (rate / res["numpy"])])
    table = _common.table(["floats per row", "reader", "k samples/s", "GB/s",
                           "ratio to NumPy"], rows)
    targets = []
    for width in WIDTHS:
        res = results["bandwidth"][str(width)]
        for key, how in (("dataset", "drained in a tf.function"),
                         ("dataset_fit", "in fit")):
            ratio = res[key] / res["numpy"]
            floor = res["floor" + key[len("dataset"):]] / res["numpy"]
            targets.append(_common.target(
                "%d-float rows, DataSet.train %s >= 50%% of NumPy's gather" % (width, how),
                ratio >= 0.5, "%.0f%%; the pre-built floor is %.0f%%" % (100 * ratio,
                                                                       100 * floor)))
    wide = results["bandwidth"][str(max(WIDTHS))]
    ratio = wide["dataset"] / wide["h5py_fancy"]
    targets.append(_common.target("%d-float rows, DataSet.train >= 10x h5py fancy indexing"
                                  % max(WIDTHS), ratio >= 10, "%.1fx" % ratio))
    return "\n".join([_common.header("matex.readers.DataSet vs NumPy's in-memory gather",
                                     command), table, "", "Targets:", ""] + targets)


def main():
    args = _common.parse_args(__doc__.splitlines()[0], WORKERS, repeats=1)
    if args.worker:
        worker_bandwidth(args)
        return
    kept = os.environ.get("MATEX_BENCH_DIR")
    folder = kept or tempfile.mkdtemp(prefix="matex-bandwidth-")
    try:
        started = time.perf_counter()
        write_files(folder, args.quick)
        print("wrote the files in %.1f s" % (time.perf_counter() - started), file=sys.stderr)
        os.environ["MATEX_BENCH_DIR"] = folder
        flags = ["--quick"] if args.quick else []
        results = _common.run_phases(__file__, {"bandwidth": dict(nranks=1, args=flags)},
                                     args.repeats)
    finally:
        if not kept:
            shutil.rmtree(folder, ignore_errors=True)
    command = "python benchmarks/reader_bandwidth.py" + (" --quick" if args.quick else "")
    print(report(results, command))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
