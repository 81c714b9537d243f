"""Train from scientific files with ``matex.readers``: HDF5, CSV and netCDF, read sharded.

    matexrun -n 2 examples/readers_train.py
    matexrun -n 2 examples/readers_train.py --format csv --rows 2048 --epochs 2

Rank 0 writes one small file per format (a labelled two-class problem: the
label says whether the first half of a row's features sums to more than the
second half), then every rank opens it with ``matex.readers.DataSet``:
each rank reads only its share, one shuffle per epoch that all ranks agree
on, equal steps on every rank. A ``matex.keras`` model trains on
``ds.train`` and validates on ``ds.validation``. Rank 0 prints one line
per format::

    hdf5    rows 4096  steps/epoch 28  validation accuracy 0.93  weights equal on all ranks: True

``--format`` picks one format (default: all three).
"""

import argparse
import os

import h5py
import netCDF4
import numpy as np

import matex
import matex.keras as keras
from matex.readers import DataSet

FEATURES = 16


def make_rows(n, seed=0):
    """``n`` rows of FEATURES float32 features and their 0/1 label."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :FEATURES // 2].sum(1) > x[:, FEATURES // 2:].sum(1)).astype("int32")
    return x, y


def write(fmt, path, x, y):
    """Write (x, y) as an HDF5, CSV or netCDF (CDF-5) file at ``path``."""
    if fmt == "hdf5":
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = x, y
    elif fmt == "csv":
        header = ",".join(["f%d" % i for i in range(FEATURES)] + ["label"])
        np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="",
                   fmt=["%.6g"] * FEATURES + ["%d"])
    else:
        with netCDF4.Dataset(path, "w", format="NETCDF3_64BIT_DATA") as d:
            d.createDimension("sample", None)
            d.createDimension("feature", FEATURES)
            d.createVariable("x", "f4", ("sample", "feature"))[:] = x
            d.createVariable("y", "i4", ("sample",))[:] = y


def train(fmt, path, args):
    """Open ``path`` sharded over the ranks and fit a small classifier on it."""
    if fmt == "csv":
        ds = DataSet(path, features=["f%d" % i for i in range(FEATURES)], labels="label",
                     batch_size=args.batch_size, validation_split=0.2, seed=1)
    else:
        ds = DataSet(path, features="x", labels="y", batch_size=args.batch_size,
                     validation_split=0.2, seed=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(ds.train, validation_data=ds.validation, epochs=args.epochs, verbose=0)
    digest = float(sum(np.abs(w).sum() for w in model.get_weights()))
    digests = matex.comm().allgather(digest)
    steps = ds.steps_per_epoch
    ds.close()
    return history.history["val_accuracy"][-1], steps, len(set(digests)) == 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["hdf5", "csv", "netcdf", "all"], default="all")
    parser.add_argument("--rows", type=int, default=4096, help="rows written per file")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--dir", default="readers-example", help="folder for the files")
    args = parser.parse_args()
    formats = ["hdf5", "csv", "netcdf"] if args.format == "all" else [args.format]
    suffix = {"hdf5": ".h5", "csv": ".csv", "netcdf": ".nc"}
    paths = {fmt: os.path.join(args.dir, "data" + suffix[fmt]) for fmt in formats}
    if matex.rank() == 0:
        os.makedirs(args.dir, exist_ok=True)
        x, y = make_rows(args.rows)
        for fmt in formats:
            write(fmt, paths[fmt], x, y)
    matex.comm().Barrier()                   # the files exist before any rank opens them
    for fmt in formats:
        accuracy, steps, equal = train(fmt, paths[fmt], args)
        if matex.rank() == 0:
            print("%-7s rows %d  steps/epoch %d  validation accuracy %.2f  "
                  "weights equal on all ranks: %s" % (fmt, args.rows, steps, accuracy, equal),
                  flush=True)


if __name__ == "__main__":
    main()
