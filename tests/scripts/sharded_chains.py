"""Test script: tf.data chains after a MaTEx reader or matex.shard, trained with plain Keras fit.

Usage: sharded_chains.py OUT.json DATA.h5 SOURCES CHAINS

Run as ``mpiexec -n N python -m matex sharded_chains.py ...``: the Keras code
is unmodified (no DistributedOptimizer); only the data comes from MaTEx.
SOURCES: comma-separated ``reader`` (``matex.readers.DataSet(..., batch_size=G)``)
and/or ``shard`` (``matex.shard`` of a tf.data dataset of global batches).
CHAINS: comma-separated names of ``CHAINS`` below, applied to the training
(and validation) dataset before ``fit``. DATA.h5 holds ``x`` (column 0 = the
sample id) and ``y``; its last quarter is the validation part.

A layer counts, inside the model and per epoch, which sample ids this rank
trained and validated on; the outer test sums over ranks. Each rank writes
OUT.json.<rank>.
"""

import json
import sys

import h5py
import keras
import tensorflow as tf

import matex
from matex.readers import DataSet

out, path = sys.argv[1], sys.argv[2]
sources, chains = sys.argv[3].split(","), sys.argv[4].split(",")
G = 16                         # the global batch
EPOCHS = 2
with h5py.File(path, "r") as f:
    X, Y = f["x"][:], f["y"][:]
TOTAL = len(X)
SPLIT = TOTAL - TOTAL // 4     # training ids 0..SPLIT-1, validation ids SPLIT..TOTAL-1
STEPS = SPLIT // G


def scaled(x, y):
    return x * 1.0, y


# name: (training chain, validation chain or None, fit arguments)
CHAINS = {
    "plain": (lambda d: d, lambda d: d, {}),
    "map": (lambda d: d.map(scaled), lambda d: d.map(scaled), {}),
    "prefetch": (lambda d: d.prefetch(2), lambda d: d.prefetch(2), {}),
    "map.prefetch": (lambda d: d.map(scaled).prefetch(tf.data.AUTOTUNE),
                     lambda d: d.map(scaled).prefetch(tf.data.AUTOTUNE), {}),
    "cache": (lambda d: d.cache(), lambda d: d.cache(), {}),
    "take": (lambda d: d.take(STEPS - 2), lambda d: d.take(1), {}),
    "repeat.take": (lambda d: d.repeat().take(STEPS * EPOCHS), lambda d: d.map(scaled),
                    {"steps_per_epoch": STEPS}),
    "map.cache.repeat": (lambda d: d.map(scaled).cache().repeat(), lambda d: d.cache(),
                         {"steps_per_epoch": STEPS}),
    "map.take.cache.repeat.prefetch": (
        lambda d: d.map(scaled).take(STEPS - 1).cache().repeat().prefetch(1),
        lambda d: d.map(scaled).prefetch(1), {"steps_per_epoch": STEPS - 1}),
}


class CountSamples(keras.layers.Layer):
    """Per epoch: how often each sample id went through training / inference here."""

    def build(self, shape):
        self.epoch = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="epoch")
        self.seen = self.add_weight(shape=(EPOCHS, TOTAL), initializer="zeros",
                                    trainable=False, name="seen")
        self.vseen = self.add_weight(shape=(EPOCHS, TOTAL), initializer="zeros",
                                     trainable=False, name="vseen")
        self.steps = self.add_weight(shape=(EPOCHS,), initializer="zeros",
                                     trainable=False, name="steps")

    def call(self, inputs, training=False):
        counts = tf.math.bincount(tf.cast(inputs[:, 0], tf.int32), minlength=TOTAL,
                                  maxlength=TOTAL, dtype=tf.float32)
        this_epoch = tf.one_hot(self.epoch, EPOCHS)
        if training:
            self.seen.assign_add(this_epoch[:, None] * counts[None, :])
            self.steps.assign_add(this_epoch)
        else:
            self.vseen.assign_add(this_epoch[:, None] * counts[None, :])
        return inputs[:, 1:]


def data(source):
    """(training, validation) datasets of this rank's batches, and what to close after."""
    if source == "reader":
        ds = DataSet(path, features="x", labels="y", batch_size=G, shuffle=True, seed=4,
                     validation_split=0.25)
        assert ds.num_samples == SPLIT and ds.num_validation_samples == TOTAL - SPLIT
        return ds.train, ds.validation, ds
    train = tf.data.Dataset.from_tensor_slices((X[:SPLIT], Y[:SPLIT]))
    train = train.shuffle(SPLIT, seed=4).batch(G)       # the same order on every rank
    validation = tf.data.Dataset.from_tensor_slices((X[SPLIT:], Y[SPLIT:])).batch(G)
    return matex.shard(train), matex.shard(validation), None


results = {}
for source in sources:
    for name in chains:
        train_chain, validation_chain, fit_args = CHAINS[name]
        train, validation, closing = data(source)
        counter = CountSamples()
        model = keras.Sequential([keras.Input((X.shape[1],)), counter, keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        epoch = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda e, logs, counter=counter: counter.epoch.assign(e))
        model.fit(train_chain(train), validation_data=validation_chain(validation),
                  epochs=EPOCHS, verbose=0, callbacks=[epoch], **fit_args)
        results["%s/%s" % (source, name)] = {
            "seen": counter.seen.numpy().tolist(),
            "vseen": counter.vseen.numpy().tolist(),
            "steps": counter.steps.numpy().tolist(),
        }
        if closing is not None:
            closing.close()
with open("%s.%d" % (out, matex.rank()), "w") as f:
    json.dump({"results": results, "split": SPLIT, "total": TOTAL, "global_batch": G,
               "steps": STEPS, "size": matex.size()}, f)
