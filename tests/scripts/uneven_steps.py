"""Test script: data whose batches, once sharded, differ in number between ranks (a mistake).

Usage: uneven_steps.py [shard | reader DATA.h5]      (under mpiexec -n 2 python -m matex)

An unmodified-style Keras script that drops corrupt samples AFTER the data
was divided among the ranks: ``.filter`` keeps only batches without NaN.
The three corrupt samples all fall in rank 0's share, so rank 0 has 1
training batch per epoch and rank 1 has 4.

- ``shard`` (default): ``matex.shard`` of a tf.data dataset of global
  batches of 16 (rank 0 takes rows 0-7 of each); samples 16, 32 and 48 are
  NaN.
- ``reader DATA.h5``: ``matex.readers.DataSet(batch_size=16, shuffle=False)``
  (rank 0 reads samples 0-31, rank 1 samples 32-63, 8 per batch); samples 8,
  16 and 24 are NaN. Rank 0 of the job writes DATA.h5 first.

Each rank prints ``finished rank R`` when ``fit`` returns. Doing the filter
before sharding (or before the reader, on the files) keeps the ranks equal.
"""

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import matex

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
source = sys.argv[1] if len(sys.argv) > 1 else "shard"
N = 64
ids = np.arange(N, dtype="float32")
x = np.stack([ids, np.sin(ids)], axis=1)
y = (ids % 2).astype("int64")


def complete(a, b):
    """Whether a batch holds no corrupt (NaN) sample."""
    return tf.reduce_all(tf.math.is_finite(a))


if source == "shard":
    x[[16, 32, 48], 1] = np.nan
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    train = matex.shard(train).filter(complete)
else:
    import h5py

    from matex.readers import DataSet

    path = sys.argv[2]
    x[[8, 16, 24], 1] = np.nan
    if rank == 0 and not os.path.exists(path):
        with h5py.File(path + ".part", "w") as f:
            f["x"], f["y"] = x, y
        os.replace(path + ".part", path)
    while not os.path.exists(path):
        time.sleep(0.05)
    data = DataSet(path, features="x", labels="y", batch_size=16, shuffle=False)
    train = data.train.filter(complete)

model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
try:
    model.fit(train, epochs=2, verbose=0)
except Exception as exc:  # noqa: BLE001 - recorded for the test, then raised as it was
    # each rank's own record: the first rank to raise aborts the job and may cut
    # the others' tracebacks short on stderr
    with open(os.environ["UNEVEN_OUT"] + ".%d" % rank, "w") as f:
        f.write("%s: %s" % (type(exc).__name__, exc))
    raise
print("finished rank %d" % rank, flush=True)
