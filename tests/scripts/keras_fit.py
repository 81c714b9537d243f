"""Test script (never mentions MaTEx): fit/evaluate/predict on generated data.

Usage: keras_fit.py OUT.json KINDS N_SAMPLES BATCH [shuffle] [unseeded]

KINDS: comma-separated arrays | dataset | generator | pydataset; each trains
its own model on that kind of input, with validation (arrays:
validation_split=0.25; dataset: a tf.data dataset; generator: arrays;
pydataset: a PyDataset; the last three of separate samples). Column 0 of x
is the sample id; a layer counts, inside the model and per epoch, which
samples each rank trained on (and at which step of the epoch) and validated
on.

Seeding: by default each process seeds Keras with its rank
(OMPI_COMM_WORLD_RANK, 0 alone), so ranks build different initial weights
and one process builds rank 0's. "unseeded": nothing is seeded.
"shuffle": arrays and pydataset fit with shuffle=True; the dataset is
.shuffle()d unseeded; the generator draws its order from np.random and
random. Without it nothing is shuffled (pydataset: shuffle=False).
"""

import json
import os
import random
import sys

import keras
import numpy as np
import tensorflow as tf

out, kinds, n, batch = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
shuffle = "shuffle" in sys.argv[5:]
unseeded = "unseeded" in sys.argv[5:]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
EPOCHS = 3
nv = max(1, n // 4)                      # validation samples (ids n .. n+nv-1)
total = n + nv
rng = np.random.default_rng(0)
feats = rng.normal(size=(total, 4)).astype("float32")
ids = np.arange(total, dtype="float32")[:, None]
x_all = np.concatenate([ids, feats], axis=1)
y_all = (feats.sum(1) > 0).astype("int64")
x, y, xv, yv = x_all[:n], y_all[:n], x_all[n:], y_all[n:]


class CountSamples(keras.layers.Layer):
    """Per epoch: how often each sample id went through training / inference here."""

    def build(self, shape):
        self.epoch = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="epoch")
        self.seen = self.add_weight(shape=(EPOCHS, total), initializer="zeros",
                                    trainable=False, name="seen")
        self.vseen = self.add_weight(shape=(EPOCHS, total), initializer="zeros",
                                     trainable=False, name="vseen")
        self.step = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                    trainable=False, name="step")
        self.when = self.add_weight(shape=(EPOCHS, total), initializer="zeros",
                                    trainable=False, name="when")

    def call(self, inputs, training=False):
        counts = tf.math.bincount(tf.cast(inputs[:, 0], tf.int32), minlength=total,
                                  maxlength=total, dtype=tf.float32)
        per_epoch = tf.one_hot(self.epoch, EPOCHS)[:, None] * counts[None, :]
        if training:
            self.seen.assign_add(per_epoch)
            self.step.assign_add(1)
            self.when.assign_add(per_epoch * tf.cast(self.step, tf.float32))
        else:
            self.vseen.assign_add(per_epoch)
        return inputs[:, 1:]

    def start_epoch(self, epoch):
        self.epoch.assign(epoch)
        self.step.assign(0)


class Batches(keras.utils.PyDataset):
    def __init__(self, xs, ys):
        super().__init__()
        self.xs, self.ys = xs, ys

    def __len__(self):
        return -(-len(self.xs) // batch)

    def __getitem__(self, i):
        return self.xs[i * batch:(i + 1) * batch], self.ys[i * batch:(i + 1) * batch]


def gen():
    for epoch in range(EPOCHS):
        order = np.random.permutation(n) if shuffle else np.arange(n)
        starts = list(range(0, n, batch))
        if shuffle:
            random.shuffle(starts)
        for i in starts:
            rows = order[i:i + batch]
            yield x[rows], y[rows]


def fit_inputs(kind):
    """fit's arguments, the ids trained on, the ids validated on."""
    if kind == "arrays":
        split = int(np.floor(n * 0.75))      # as Keras splits off validation_split=0.25
        return (dict(x=x, y=y, batch_size=batch, shuffle=shuffle, validation_split=0.25),
                range(split), range(split, n))
    return fit_data(kind), range(n), range(n, total)


def fit_data(kind):
    if kind == "dataset":
        train = tf.data.Dataset.from_tensor_slices((x, y))
        if shuffle:
            train = train.shuffle(n)
        return dict(x=train.batch(batch),
                    validation_data=tf.data.Dataset.from_tensor_slices((xv, yv)).batch(batch))
    if kind == "generator":
        return dict(x=gen(), steps_per_epoch=-(-n // batch), validation_data=(xv, yv))
    return dict(x=Batches(x, y), shuffle=shuffle, validation_data=Batches(xv, yv))


def dense_weights(model):
    return [w.tolist() for layer in model.layers[1:] for w in layer.get_weights()]


results = {}
for kind in kinds:
    if not unseeded:
        keras.utils.set_random_seed(rank)
    counter = CountSamples()
    model = keras.Sequential([keras.Input((5,)), counter,
                              keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial = dense_weights(model)
    epochs = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: counter.start_epoch(e))
    inputs, train_ids, val_ids = fit_inputs(kind)
    history = model.fit(epochs=EPOCHS, verbose=0, callbacks=[epochs], **inputs)
    seen, vseen, when = counter.seen.numpy(), counter.vseen.numpy(), counter.when.numpy()
    loss, acc = model.evaluate(x, y, batch_size=7, verbose=0)
    pred = model.predict(x, batch_size=9, verbose=0)
    results[kind] = {
        "train_ids": list(train_ids),
        "val_ids": list(val_ids),
        "initial": initial,
        "weights": dense_weights(model),
        "seen": seen.tolist(),
        "vseen": vseen.tolist(),
        "when": when.tolist(),
        "history": history.history,
        "evaluate": [loss, acc],
        "pred": pred.tolist(),
    }
with open("%s.%d" % (out, rank), "w") as f:
    json.dump(results, f)
