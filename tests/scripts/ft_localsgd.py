"""Test script: fewer synchronisations in fit under ULFM; a rank dies mid-training.

Usage: ft_localsgd.py OUT METHOD (localsgd | diloco | delay). 300 samples,
global batch 32 (10 steps per epoch), 2 epochs. LocalSGD/DiLoCo: ``fit``,
sync_every=4 (a rank dies between two syncs). delay: a custom loop under
``matex.run_resilient`` with ``DistributedOptimizer(delay=1)`` (a rank dies
while the previous step's non-blocking allreduce is in flight; not ``fit``:
an explicitly distributed optimizer makes the script shard its own data, so
``fit`` does not re-divide it). A layer counts, replicated on every rank, how
often each sample was trained on (rolled back with the rest). Writes
OUT.<world rank> on every survivor: the counts, the step counter at the start
of every step (a rollback shows as a step seen again), digests; for delay=1
also whether a gradient was still in flight at the end (``matex.flush``
applies it).
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
elif method == "delay":
    optimizer = matex.DistributedOptimizer(keras.optimizers.Adam(0.01), delay=1)
else:
    optimizer = matex.LocalSGD(keras.optimizers.Adam(0.01), sync_every=H)
model.compile(optimizer=optimizer, metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
steps_begun, recoveries = [], []


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        steps_begun.append(int(self.model.optimizer.iterations))

    def on_rank_loss(self, info):
        # after restore and sync: delay=1's request in flight must be gone
        pending = getattr(optimizer._matex.strategy, "pending", lambda: None)()
        recoveries.append({"lost": info.lost, "new_size": info.new_size, "pending": pending})


if method == "delay":
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps = -(-n // batch)

    @tf.function
    def train(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    def step(i):
        # global batch i of this epoch's permutation; this rank's slice as seen now, so a
        # redone step is re-divided among the survivors
        steps_begun.append(int(optimizer.iterations))
        order = np.random.default_rng([7, i // steps]).permutation(n)
        idx = order[(i % steps) * batch:(i % steps + 1) * batch]
        lo = len(idx) * matex.rank() // matex.size()
        hi = len(idx) * (matex.rank() + 1) // matex.size()
        train(x[idx[lo:hi]], y[idx[lo:hi]])

    matex.on_rank_loss(Record().on_rank_loss)
    optimizer.build(model.trainable_variables)
    matex.run_resilient(step, steps * epochs, model.variables + optimizer.variables, optimizer,
                        undo_on_redo=[model.layers[0].seen])
else:
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, verbose=0,
              callbacks=[Record()])
from matex import _resilience  # noqa: E402
from mpi4py import MPI  # noqa: E402

strategy = model.optimizer._matex.strategy
flushed = matex.flush(model.optimizer) if method == "delay" else None
# optimizer slots stay local (they differ across ranks); the model synchronised at step 20
state = [v.numpy() for v in model.variables]
result = {"seen": model.layers[0].seen.numpy().tolist(), "size": matex.size(),
          "iterations": int(model.optimizer.iterations), "steps_begun": steps_begun,
          "recoveries": recoveries, "digest": _resilience.digest(state),
          "own_digest": _resilience.digest([np.asarray(v) for v in getattr(
              strategy, "own_variables", list)()]),
          "flushed": flushed,
          "pid": os.getpid()}
with open("%s.%d" % (out, MPI.COMM_WORLD.Get_rank()), "w") as f:
    json.dump(result, f)
