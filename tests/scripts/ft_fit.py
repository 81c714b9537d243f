"""Test script (never mentions MaTEx): fit that counts, inside the model, every sample
trained on, replicated on all ranks (an allreduce in the forward pass), so the count
survives the loss of ranks. Writes OUT.<world rank> on every rank that finishes.

Usage: ft_fit.py OUT N_SAMPLES BATCH EPOCHS [validate]

"validate": fit also validates, after every epoch, on the first 64 samples.
"repeat": fit reads a repeated tf.data dataset with steps_per_epoch (one pass per epoch).
"""

import json
import os
import socket
import sys

import keras
import numpy as np
import tensorflow as tf

out, n, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
validate = "validate" in sys.argv[5:]
repeat = "repeat" in sys.argv[5:]
with open("%s.pid.%s" % (out, os.environ.get("OMPI_COMM_WORLD_RANK", "0")), "w") as f:
    f.write(str(os.getpid()))   # lets a test kill this rank from outside
rng = np.random.default_rng(0)
feats = rng.normal(size=(n, 6)).astype("float32")
x = np.concatenate([np.arange(n, dtype="float32")[:, None], feats], axis=1)
y = (feats[:, :3].sum(1) > feats[:, 3:].sum(1)).astype("int64")


class CountSamples(keras.layers.Layer):
    """seen[i] = how many times sample i was trained on, summed over all ranks."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(n,), initializer="zeros", trainable=False, name="seen")

    def call(self, inputs, training=False):
        if training:
            import matex  # the test's own instrument, not part of the training code

            ids = tf.cast(inputs[:, 0], tf.int32)
            local = tf.math.bincount(ids, minlength=n, maxlength=n, dtype=tf.float32)
            self.seen.assign_add(matex.allreduce(local, "sum"))
        return inputs[:, 1:]


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((7,)), CountSamples(),
                          keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

from matex import _runtime  # noqa: E402 - the test's instrument: communicators in use now

start_comms = (_runtime.comm(), _runtime.control())
recoveries = []
world_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


class Progress(keras.callbacks.Callback):
    """Marks that training is under way (for tests that kill from outside) and
    records recoveries (MaTEx calls ``on_rank_loss`` on callbacks that have it)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2 and not os.path.exists("%s.ready%d.json" % (out, world_rank)):
            open(out + ".started", "w").close()
            with open("%s.ready%d.json" % (out, world_rank), "w") as f:
                json.dump({"rank": world_rank, "hostname": socket.gethostname(),
                           "pid": os.getpid()}, f)

    def on_rank_loss(self, info):
        recoveries.append({"lost": info.lost, "new_size": info.new_size,
                           "started": info.started, "seconds": info.seconds})


progress = Progress()
data = dict(x=x, y=y, batch_size=batch, shuffle=True)
if repeat:
    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(),
                steps_per_epoch=-(-n // batch))
history = model.fit(epochs=epochs, verbose=0, callbacks=[progress],
                    validation_data=(x[:64], y[:64]) if validate else None, **data)
loss, acc = model.evaluate(x, y, verbose=0, callbacks=[progress])
import matex  # noqa: E402  (for the report only)
from matex import _resilience  # noqa: E402

state = [v.numpy() for v in model.variables + model.optimizer.variables]
result = {"seen": model.layers[0].seen.numpy().tolist(), "loss": history.history["loss"],
          "val_loss": history.history.get("val_loss"),
          "accuracy": acc, "size": matex.size(), "digest": _resilience.digest(state),
          "iterations": int(model.optimizer.iterations), "recoveries": recoveries,
          "hostname": socket.gethostname()}
from mpi4py import MPI  # noqa: E402

result["freed"] = [c == MPI.COMM_NULL for c in start_comms]   # replaced ones are released

with open("%s.%d" % (out, MPI.COMM_WORLD.Get_rank()), "w") as f:
    json.dump(result, f)
