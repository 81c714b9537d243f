"""A short Keras training run across hosts: a plain single-process script.

Usage: matexrun ... hosts_fit.py OUTDIR
Nothing here mentions MaTEx: under ``matexrun`` (``python -m matex``) fit
shards the data over the ranks, averages gradients and reports global
metrics. Each rank writes OUTDIR/rank<N>.json with its hostname, the SHA-256
of its final weights, the loss history and the evaluated accuracy.
"""

import hashlib
import json
import os
import socket
import sys

import keras
import numpy as np

out = sys.argv[1]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 8)).astype("float32")
y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype("int64")

keras.utils.set_random_seed(rank)      # different on purpose: rank 0's weights must win
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, batch_size=64, epochs=3, verbose=0)
loss, accuracy = model.evaluate(x, y, batch_size=256, verbose=0)

digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                 for w in model.get_weights())).hexdigest()
report = {"rank": rank, "hostname": socket.gethostname(), "weights": digest,
          "loss": [float(v) for v in history.history["loss"]], "accuracy": float(accuracy),
          "steps": int(model.optimizer.iterations.numpy())}
with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
    json.dump(report, f)
print("rank %d on %s: loss %s, accuracy %.3f" % (rank, report["hostname"], report["loss"],
                                               accuracy), flush=True)
