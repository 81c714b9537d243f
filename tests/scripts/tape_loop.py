"""Test script (never mentions MaTEx): an ordinary GradientTape loop, ranks differing.

Usage: tape_loop.py OUT.json [REFERENCE_RANKS]

Each process seeds itself with its rank (OMPI_COMM_WORLD_RANK, 0 alone), so
ranks build different initial weights, and trains on its own data (drawn
from its rank). Alone with REFERENCE_RANKS=k it computes what k ranks should
do: start from rank 0's initial weights and apply, at every step, the
average of the k ranks' gradients, each on that rank's data.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow import keras

out = sys.argv[1]
reference_ranks = int(sys.argv[2]) if len(sys.argv) > 2 else None
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
EPOCHS, ROWS, BATCH = 3, 96, 16

keras.utils.set_random_seed(rank)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.Adam(0.02)
initial = [w.tolist() for w in model.get_weights()]


def data(r):
    rng = np.random.default_rng(100 + r)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x @ np.linspace(-1, 1, 6).astype("float32") + r)[:, None]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


@tf.function
def gradients(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
    return loss, tape.gradient(loss, model.trainable_variables)


@tf.function
def train_step(xb, yb):
    loss, grads = gradients(xb, yb)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = []
for epoch in range(EPOCHS):
    if reference_ranks is None:
        for xb, yb in data(rank):
            losses.append(float(train_step(xb, yb)))
    else:
        for batches in zip(*[data(r) for r in range(reference_ranks)]):
            per_rank = [gradients(xb, yb) for xb, yb in batches]
            losses.append(float(per_rank[0][0]))
            mean = [tf.add_n(list(g)) / reference_ranks for g in zip(*[g for _, g in per_rank])]
            optimizer.apply_gradients(zip(mean, model.trainable_variables))

with open("%s.%d" % (out, rank), "w") as f:
    json.dump({"initial": initial, "weights": [w.tolist() for w in model.get_weights()],
               "iterations": int(optimizer.iterations), "losses": losses}, f)
