"""A loss surface on 3 ranks under ULFM, rank 2 SIGKILLed while it holds a grid point.

Usage: surface_ft.py OUT_JSON SURFACE_H5. Rank 2 kills itself inside its first
point's loss (not a later one: the grid takes ~0.2 s, and a rank 2 that started
late got fewer than 4 of the 36 points in one make test run, so nothing was
killed); the survivors finish the grid. Rank 0 writes the surface, the
analytic one (a linear model with MSE) and the rank count afterwards to OUT_JSON.
"""

import json
import os
import signal
import sys

import numpy as np

import matex
import matex.keras as keras
import matex.science as science
from matex.science import _objective

keras.config.set_floatx("float64")
out, path = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
x = rng.standard_normal((400, 6))
y = x @ rng.standard_normal((6, 2))
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
model.compile(loss="mse", optimizer="sgd")
world_rank = matex.rank()

calls = []
original = _objective.Objective.loss


def loss(self):
    calls.append(1)
    if world_rank == 2 and len(calls) == 1:
        os.kill(os.getpid(), signal.SIGKILL)   # holding a point the queue handed out
    return original(self)


_objective.Objective.loss = loss
surface = science.loss_surface(model, (x, y), resolution=(6, 6), span=0.5, path=path,
                               batch_size=50, ranks_per_point=1, verbose=1)
stored = science.read_surface(path)
w, b = model.get_weights()
expected = [[float(np.mean((x @ (w + p * stored["d1"][0] + q * stored["d2"][0])
                            + b - y) ** 2)) for q in stored["y"]] for p in stored["x"]]
if matex.rank() == 0:
    with open(out, "w") as f:
        json.dump({"surface": surface.tolist(), "expected": expected, "size": matex.size(),
                   "file": stored["loss"].tolist(), "computed_by_rank0": len(calls)}, f)
