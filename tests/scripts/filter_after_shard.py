"""Test script: a .filter() after matex.shard() leaves rank 0 with fewer batches (a mistake).

Rank 0's slices of the last three global batches are filtered away; rank 1
keeps all of its. fit must fail with one clear error on every rank, not hang.
"""

import os

import keras
import numpy as np
import tensorflow as tf

import matex

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
x = np.arange(64, dtype="float32")[:, None]
ds = tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(8)
ds = matex.shard(ds).filter(
    lambda a, b: tf.logical_or(tf.constant(rank == 1), tf.reduce_min(a) < 40))
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(ds, epochs=2, verbose=0)
print("finished", rank, flush=True)
