"""Test script: a custom GradientTape loop under matex.run_resilient.

Usage: ft_custom_loop.py OUT N_SAMPLES BATCH EPOCHS. Step i takes global batch
i % steps of a per-epoch permutation and keeps this rank's slice of it, as seen
at call time (so a redone step is re-divided among the survivors).
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import matex

out, n, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
steps = -(-n // batch)
rng = np.random.default_rng(0)
x = rng.normal(size=(n, 6)).astype("float32")
y = (x[:, :3].sum(1) > x[:, 3:].sum(1)).astype("int64")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2)])
# gradients weighted by each rank's share of the global batch, then summed
optimizer = matex.DistributedOptimizer(keras.optimizers.Adam(0.01), op="sum")
seen = tf.Variable(tf.zeros([n]))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train(xb, yb, ids, rows):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    seen.assign_add(matex.allreduce(tf.math.bincount(ids, minlength=n, maxlength=n,
                                                     dtype=tf.float32), "sum"))
    grads = tape.gradient(loss, model.trainable_variables)
    weight = tf.cast(rows, tf.float32) / matex.allreduce(tf.cast(rows, tf.float32), "sum")
    optimizer.apply([g * weight for g in grads], model.trainable_variables)


def step(i):
    order = np.random.default_rng([7, i // steps]).permutation(n)
    idx = order[(i % steps) * batch:(i % steps + 1) * batch]
    lo, hi = len(idx) * matex.rank() // matex.size(), len(idx) * (matex.rank() + 1) // matex.size()
    mine = idx[lo:hi]
    train(x[mine], y[mine], tf.constant(mine, tf.int32), len(mine))


optimizer.build(model.trainable_variables)
recoveries = matex.run_resilient(step, steps * epochs, model.variables + optimizer.variables,
                                 optimizer, undo_on_redo=[seen])
from matex import _resilience  # noqa: E402
from mpi4py import MPI  # noqa: E402

with open("%s.%d" % (out, MPI.COMM_WORLD.Get_rank()), "w") as f:
    json.dump({"seen": seen.numpy().tolist(), "size": matex.size(), "recoveries": recoveries,
               "iterations": int(optimizer.iterations),
               "digest": _resilience.digest([v.numpy() for v in model.variables])}, f)
