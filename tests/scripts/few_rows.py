"""Test script (never mentions MaTEx): predict/evaluate/fit on fewer rows than ranks.

Usage: few_rows.py OUT NRANKS

After a normal fit, it predicts and evaluates on 1, 2 and NRANKS-1 rows (one
row at a time, the usual way to show a few predictions), fits on fewer
samples than ranks with a 1-row validation set, and ends with a last batch
smaller than the number of ranks. Writes OUT.<rank> (JSON).
"""

import json
import os
import sys

import keras
import numpy as np

out, nranks = sys.argv[1], int(sys.argv[2])
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
keras.utils.set_random_seed(3)
rng = np.random.default_rng(0)
x = rng.normal(size=(40, 5)).astype("float32")
y = (x.sum(1) > 0).astype("int64")
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
result = {}
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
for rows in sorted({1, 2, max(1, nranks - 1)}):
    result["predict%d" % rows] = model.predict(x[:rows], verbose=0).tolist()
    result["evaluate%d" % rows] = model.evaluate(x[:rows], y[:rows], verbose=0)
result["one_at_a_time"] = [model.predict(x[[i]], verbose=0).tolist() for i in range(3)]
# fewer training samples than ranks, a 1-row validation set
history = model.fit(x[:nranks - 1], y[:nranks - 1], batch_size=8, epochs=2, shuffle=False,
                    validation_data=(x[-1:], y[-1:]), verbose=0)
result["small_fit"] = history.history
# a last batch smaller than the number of ranks: 9 rows, global batch 8
history = model.fit(x[:9], y[:9], batch_size=8, epochs=1, shuffle=False, verbose=0)
result["short_last_batch"] = history.history
result["weights"] = [w.tolist() for w in model.get_weights()]
with open("%s.%d" % (out, rank), "w") as f:
    json.dump(result, f)
