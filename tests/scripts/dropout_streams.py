"""Test script: in-step randomness (Dropout, GaussianNoise, RandomFlip) under fit.

Usage: dropout_streams.py OUT.json [masks] [regression SEED]

Writes OUT.json.<rank>.

"masks": a model on a fixed input (every row 1, 1+1/64, ..., in an 8x8 image)
records, at every training step, what each rank's slice looked like after
Dropout(0.5), GaussianNoise(1) and RandomFlip("horizontal") (the input is
not symmetric, so a flip shows), and the final SeedGenerator states. Global
batches of 16; nothing is learned (the recorders feed a zero head trained at
rate 0). On several ranks also "unpatched": the same with Keras's own
``SeedGenerator.next`` put back.

"regression SEED": a small MLP with Dropout(0.3) fits a smooth function for
a few epochs (initial weights from seed 0, dropout generators from SEED);
reports the held-out loss (no dropout at evaluation).

Ranks seed Keras with their rank; MaTEx starts every rank from rank 0's
variables (the generator states included).
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf


out = sys.argv[1]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
BATCH, STEPS = 16, 100


class Record(keras.layers.Layer):
    """Keeps a copy of its input at every training step (steps, rows, features)."""

    def __init__(self, rows, features, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.features = rows, features

    def build(self, shape):
        self.step = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                    trainable=False, name="step")
        self.seen = self.add_weight(shape=(STEPS, self.rows, self.features),
                                    initializer="zeros", trainable=False, name="seen")

    def call(self, inputs, training=False):
        flat = tf.reshape(inputs, (-1, self.features))
        if training:
            self.seen.assign(tf.tensor_scatter_nd_update(
                self.seen, tf.reshape(self.step, (1, 1)), flat[None]))
            self.step.assign_add(1)
        return flat


def generator_states(model):
    return {v.path: v.numpy().tolist() for v in model.variables
            if v.name == "seed_generator_state"}


def masks():
    keras.utils.set_random_seed(rank)
    rows = BATCH // size
    inputs = keras.Input((64,))
    image = keras.layers.Reshape((8, 8, 1))(inputs)
    branches = [
        Record(rows, 64, name="rec_dropout")(keras.layers.Dropout(0.5)(inputs)),
        Record(rows, 64, name="rec_noise")(keras.layers.GaussianNoise(1.0)(inputs)),
        Record(rows, 64, name="rec_flip")(keras.layers.RandomFlip("horizontal")(image)),
    ]
    head = keras.layers.Dense(1, kernel_initializer="zeros")
    model = keras.Model(inputs, head(keras.layers.Concatenate()(branches)))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = np.tile(1.0 + np.arange(64, dtype="float32") / 64.0, (BATCH * STEPS, 1))
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0)
    return {
        "seen": {name: model.get_layer("rec_" + name).seen.numpy().tolist()
                 for name in ("dropout", "noise", "flip")},
        "generators": generator_states(model),
        "input": x[0].tolist(),
    }


def regression(seed):
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, size=(1024, 4)).astype("float32")
    y = (np.sin(x[:, :1] * 1.5) + 0.5 * x[:, 1:2] * x[:, 2:3] - 0.3 * x[:, 3:]).astype("float32")
    keras.utils.set_random_seed(0 if rank == 0 else 100 + rank)   # weights: rank 0's anyway
    layers = [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64, activation="relu"),
              keras.layers.Dense(1)]
    model = keras.Sequential([keras.Input((4,)), layers[0], keras.layers.Dropout(0.3, seed=seed),
                              layers[1], keras.layers.Dropout(0.3, seed=seed + 1), layers[2]])
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse")
    history = model.fit(x[:768], y[:768], batch_size=32, epochs=12, shuffle=False, verbose=0)
    return {"loss": history.history["loss"],
            "heldout": float(model.evaluate(x[768:], y[768:], verbose=0))}


class TfNoise(keras.layers.Layer):
    """TensorFlow's own randomness inside a layer (as keras-io's VAE ``Sampling`` layer)."""

    def call(self, inputs):
        return inputs + tf.random.normal(tf.shape(inputs))


def tf_native():
    """A layer drawing tf.random.normal, every rank seeded alike (TF's global seed 0)."""
    keras.utils.set_random_seed(0)
    rows = BATCH // size
    inputs = keras.Input((64,))
    noise = Record(rows, 64, name="rec_tfnoise")(TfNoise()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(noise))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = np.ones((BATCH * 10, 64), "float32")
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    return model.get_layer("rec_tfnoise").seen.numpy()[:10].tolist()


results = {}
if "masks" in sys.argv[2:]:
    results["masks"] = masks()
    results["masks"]["tf_native"] = tf_native()
    if size > 1:   # again with Keras's own SeedGenerator.next
        patched = keras.random.SeedGenerator.next
        keras.random.SeedGenerator.next = getattr(patched, "_matex_original", patched)
        try:
            results["masks"]["unpatched"] = masks()
        finally:
            keras.random.SeedGenerator.next = patched
if "regression" in sys.argv[2:]:
    results["regression"] = regression(int(sys.argv[sys.argv.index("regression") + 1]))
with open("%s.%d" % (out, rank), "w") as f:
    json.dump(results, f)
