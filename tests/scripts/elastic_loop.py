"""Test script written for Horovod's elastic API (never mentions MaTEx): a custom loop.

Usage: matexrun --ft --horovod ... elastic_loop.py OUT STEPS_PER_EPOCH EPOCHS [fit]

``hvd.elastic.run`` runs ``train(state)``; ``state`` is a
``TensorFlowKerasState`` holding the model, its ``hvd.DistributedOptimizer``
and three objects: ``batch`` (steps done), ``seen`` (how many times each
sample was trained on, summed over ranks) and ``sizes`` (the number of ranks
of each step). Step i trains on global batch i % STEPS_PER_EPOCH of a
per-epoch permutation, divided among the ranks there are when it runs, and
commits. Every rank that finishes writes OUT.<world rank> (JSON).

"fit": then a second phase, Horovod's elastic Keras recipe: ``model.fit``
inside ``hvd.elastic.run`` with a ``KerasState`` (``epoch``, ``batch``) and the
three elastic callbacks, committing at epoch ends only, for 3 epochs of
STEPS_PER_EPOCH steps on each rank's shard; every rank that finishes it
writes OUT.fit.<world rank>.
"""

import hashlib
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras

hvd.init()
out, per_epoch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
BATCH = 12
n = per_epoch * BATCH
rng = np.random.default_rng(0)
x = rng.normal(size=(n, 6)).astype("float32")
y = (x[:, :3].sum(1) > x[:, 3:].sum(1)).astype("int64")
keras.utils.set_random_seed(hvd.rank())   # different on purpose: the sync must make them equal
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(2)])
optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, seen=np.zeros(n), sizes=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


@hvd.elastic.run
def train(state):
    while state.batch < per_epoch * epochs:
        i = state.batch
        order = np.random.default_rng([7, i // per_epoch]).permutation(n)
        rows = order[(i % per_epoch) * BATCH:(i % per_epoch + 1) * BATCH]
        lo, hi = BATCH * hvd.rank() // hvd.size(), BATCH * (hvd.rank() + 1) // hvd.size()
        mine = rows[lo:hi]
        train_step(x[mine], y[mine])
        counts = hvd.allreduce(tf.math.bincount(tf.constant(mine, tf.int32), minlength=n,
                                                maxlength=n), op=hvd.Sum)
        state.seen = state.seen + counts.numpy()
        state.sizes = state.sizes + [hvd.size()]
        state.batch = i + 1
        state.commit()
    return state.batch


done = train(state)
digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes()
                                 for v in model.variables + list(optimizer.variables)))
with open("%s.%s" % (out, os.environ.get("OMPI_COMM_WORLD_RANK", "0")), "w") as f:
    json.dump({"returned": done, "batch": state.batch, "size": hvd.size(),
               "iterations": int(optimizer.iterations.numpy()),
               "seen": state.seen.tolist(), "sizes": state.sizes, "resets": resets,
               "digest": digest.hexdigest()}, f)

if "fit" not in sys.argv[4:]:
    sys.exit(0)
FIT_EPOCHS = 3
fit_model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
fit_model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
fit_state = hvd_keras.elastic.KerasState(fit_model, batch=0, epoch=0)
launches = []


@hvd_keras.elastic.run
def fit(state):
    launches.append([state.epoch, hvd.size()])
    rows = np.arange(n)[hvd.rank()::hvd.size()][:BATCH * per_epoch // hvd.size()]
    callbacks = [hvd_keras.elastic.UpdateBatchStateCallback(state),
                 hvd_keras.elastic.UpdateEpochStateCallback(state),
                 hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=10 ** 6)]
    fit_model.fit(x[rows], y[rows], batch_size=BATCH // hvd.size(), verbose=0,
                  epochs=FIT_EPOCHS - state.epoch, callbacks=callbacks)


fit(fit_state)
digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes()
                                 for v in fit_model.variables))
with open("%s.fit.%s" % (out, os.environ.get("OMPI_COMM_WORLD_RANK", "0")), "w") as f:
    json.dump({"epoch": fit_state.epoch, "batch": fit_state.batch, "launches": launches,
               "iterations": int(fit_model.optimizer.iterations.numpy()),
               "digest": digest.hexdigest()}, f)
