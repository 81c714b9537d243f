"""Chaos workload (never mentions MaTEx in its model code): ``evaluate`` then ``predict``,
ROUNDS times, over N rows, with a model whose weights are set identically on every rank.

Every number is exact: inputs, weights and targets are small integers (each partial sum
stays far below 2**24), so a prediction does not depend on how the rows were divided
among the ranks or batched, and the metrics (``mae``, ``mse`` averaged over 4 outputs: a
sum of quarters) are exact global sums whatever the division. Only the loss, Keras's
mean of per-batch means weighted by batch size, rounds differently when the batches are
cut differently. Output column 0 is the row's index (passed through), so the test sees
every row exactly once and in order. Writes OUT.<world rank> (JSON) on every rank that
finishes.

Usage: chaos_predict.py OUT N ROUNDS
"""

import json
import os
import sys

import keras
import numpy as np

out, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
x = np.concatenate([np.arange(n)[:, None], rng.integers(-1, 2, size=(n, 4))], 1).astype("float32")
w1 = rng.integers(-1, 2, size=(5, 8)).astype("float32")
w1[0, :], w1[:, 0], w1[0, 0] = 0, 0, 1   # hidden unit 0 = the row index
b1 = rng.integers(-1, 2, size=8).astype("float32")
b1[0] = 0
w2 = rng.integers(-1, 2, size=(8, 4)).astype("float32")
w2[0, :], w2[:, 0], w2[0, 0] = 0, 0, 1   # output 0 = the row index
b2 = rng.integers(-1, 2, size=4).astype("float32")
b2[0] = 0
y = np.concatenate([np.arange(n)[:, None], rng.integers(-3, 4, size=(n, 3))], 1).astype("float32")

model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(4)])
model.set_weights([w1, b1, w2, b2])
model.compile(optimizer="sgd", loss="mse", metrics=["mae", "mse"])

results = []
for _ in range(rounds):
    metrics = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    predictions = model.predict(x, batch_size=64, verbose=0)
    results.append({"evaluate": {k: float(v) for k, v in metrics.items()},
                    "predict": np.asarray(predictions, "float64").tolist()})

import matex  # noqa: E402  (for the report only)
from matex import _resilience  # noqa: E402

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
with open("%s.%d" % (out, rank), "w") as f:
    json.dump({"rounds": results, "size": matex.size(),
               "digest": _resilience.digest([v.numpy() for v in model.variables])}, f)
