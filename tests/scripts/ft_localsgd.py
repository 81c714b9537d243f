"""Test script: LocalSGD / DiLoCo in fit under ULFM; a rank dies between two syncs.

Usage: ft_localsgd.py OUT METHOD (localsgd | diloco). 300 samples, global batch
32 (10 steps per epoch), 2 epochs, sync_every=4. A layer counts, replicated on
every rank, how often each sample was trained on (rolled back with the rest).
Writes OUT.<world rank> on every survivor: the counts, the step counter at
the start of every batch (a rollback shows as a step seen again), digests.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import matex

out, method = sys.argv[1], sys.argv[2]
n, batch, epochs, H = 300, 32, 2, 4
rng = np.random.default_rng(0)
feats = rng.normal(size=(n, 6)).astype("float32")
x = np.concatenate([np.arange(n, dtype="float32")[:, None], feats], axis=1)
y = (feats[:, :3].sum(1) > feats[:, 3:].sum(1)).astype("int64")


class CountSamples(keras.layers.Layer):
    def build(self, shape):
        self.seen = self.add_weight(shape=(n,), initializer="zeros", trainable=False, name="seen")

    def call(self, inputs, training=False):
        if training:
            ids = tf.cast(inputs[:, 0], tf.int32)
            local = tf.math.bincount(ids, minlength=n, maxlength=n, dtype=tf.float32)
            self.seen.assign_add(matex.allreduce(local, "sum"))
        return inputs[:, 1:]


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((7,)), CountSamples(),
                          keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
if method == "diloco":
    optimizer = matex.DiLoCo(keras.optimizers.Adam(0.01),
                             keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True), sync_every=H)
else:
    optimizer = matex.LocalSGD(keras.optimizers.Adam(0.01), sync_every=H)
model.compile(optimizer=optimizer, metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
steps_begun, recoveries = [], []


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        steps_begun.append(int(self.model.optimizer.iterations))

    def on_rank_loss(self, info):
        recoveries.append({"lost": info.lost, "new_size": info.new_size})


model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, verbose=0, callbacks=[Record()])
from matex import _resilience  # noqa: E402
from mpi4py import MPI  # noqa: E402

strategy = model.optimizer._matex.strategy
# optimizer slots stay local (they differ across ranks); the model synchronised at step 20
state = [v.numpy() for v in model.variables]
result = {"seen": model.layers[0].seen.numpy().tolist(), "size": matex.size(),
          "iterations": int(model.optimizer.iterations), "steps_begun": steps_begun,
          "recoveries": recoveries, "digest": _resilience.digest(state),
          "own_digest": _resilience.digest([np.asarray(v) for v in strategy.own_variables()]),
          "pid": os.getpid()}
with open("%s.%d" % (out, MPI.COMM_WORLD.Get_rank()), "w") as f:
    json.dump(result, f)
