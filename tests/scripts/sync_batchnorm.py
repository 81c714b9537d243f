"""Test script: BatchNormalization(synchronized=True) in fit and in a GradientTape loop.

Usage: sync_batchnorm.py OUT.json [N_SAMPLES BATCH]

Writes OUT.json.<rank> with, per part, the trained weights, the moving
statistics and the loss history:

* "fit": an unmodified fit on arrays (shuffle=False). The default 61 samples
  in batches of 15 give 2 ranks slices of 7 and 8 rows, and a last batch of
  one row: rank 0's slice of it is empty.
* "unpatched": the same, with Keras's own synchronised moments put back (what
  Keras does under MaTEx without the patch: per-rank statistics).
* "loop": a custom loop (tf.function, GradientTape, apply_gradients) on
  ``matex.shard`` of a tf.data dataset of global batches of 16 (equal slices);
  "eager": the same loop run eagerly.

Each process seeds Keras with its rank (ranks build different initial weights;
MaTEx starts every rank from rank 0's, which one process builds).
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import matex

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 61
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 15
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
EPOCHS = 3
rng = np.random.default_rng(0)
x = (rng.normal(size=(n, 4, 3)) * 2.0 + 3.0).astype("float32")
y = (x[:, :, 0].sum(1) > 12.0).astype("int64")


def build():
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([
        keras.Input((4, 3)),
        keras.layers.Dense(5),
        keras.layers.BatchNormalization(synchronized=True, momentum=0.5),   # over 2 axes
        keras.layers.Flatten(),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.BatchNormalization(synchronized=True, momentum=0.5),
        keras.layers.Dense(2),
    ])
    return model


def state(model):
    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    return {
        "weights": [w.numpy().tolist() for w in model.trainable_weights],
        "moving": [v.numpy().tolist() for layer in bns
                   for v in (layer.moving_mean, layer.moving_variance)],
    }


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit():
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss=LOSS)
    history = model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    return {**state(model), "loss": history.history["loss"]}


def unpatched():
    from keras.src.backend.tensorflow import nn

    patched = getattr(nn, "_compute_moments_sync")
    setattr(nn, "_compute_moments_sync", getattr(patched, "_matex_original", patched))
    try:
        return fit()
    finally:
        setattr(nn, "_compute_moments_sync", patched)


def loop(traced=True):
    model = build()
    optimizer = keras.optimizers.SGD(0.2)
    data = matex.shard(tf.data.Dataset.from_tensor_slices((x[:48], y[:48])).batch(16))

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    if traced:
        step = tf.function(step)
    else:
        # eagerly the first forward pass runs before the optimizer's first
        # apply takes rank 0's weights: start from them explicitly
        matex.broadcast_variables(model.variables)
    losses = []
    for _ in range(EPOCHS):
        for xb, yb in data:
            losses.append(float(matex.allreduce(step(xb, yb), "average")))
    return {**state(model), "loss": losses}


results = {"fit": fit(), "loop": loop(), "eager": loop(traced=False)}
if matex.size() > 1:
    results["unpatched"] = unpatched()
with open("%s.%d" % (out, rank), "w") as f:
    json.dump(results, f)
