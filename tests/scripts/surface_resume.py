"""A loss surface whose job is SIGKILLed midway, then resumed from its file.

Usage: surface_resume.py PATH kill|resume OUT_JSON

``kill``: rank 0 (the queue's server and the file's writer) SIGKILLs itself
right after the 7th point reached the file: the whole job dies uncleanly
(mpiexec ends the other ranks). ``resume``: the same call on the same PATH
computes only the missing points, then computes the whole surface again into
a new file (the uninterrupted reference) and rank 0 writes both to OUT_JSON.
"""

import json
import os
import signal
import sys

import numpy as np

import matex
import matex.keras as keras
import matex.science as science
from matex.science import _surface

path, mode = sys.argv[1], sys.argv[2]
keras.config.set_floatx("float64")
rng = np.random.default_rng(0)
x = rng.standard_normal((300, 5))
y = x @ rng.standard_normal((5, 2))
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
model.compile(loss="mse", optimizer="sgd")

if mode == "kill":
    put = _surface._Store.put

    def put_then_die(self, index, loss):
        put(self, index, loss)
        if int(np.count_nonzero(~np.isnan(self.values))) == 7:
            os.kill(os.getpid(), signal.SIGKILL)   # after the flush of the 7th point

    _surface._Store.put = put_then_die
else:   # count the points the resumed run computes (rank 0 stores them all)
    stored = []
    put = _surface._Store.put

    def put_counted(self, index, loss):
        stored.append(index)
        put(self, index, loss)

    _surface._Store.put = put_counted


def surface(target):
    return science.loss_surface(model, (x, y), resolution=(5, 5), span=0.5, path=target,
                                batch_size=50, ranks_per_point=1, verbose=0, seed=4)


surface(path)
if mode == "resume":
    computed = len(stored)
    reference = path + ".reference.h5"
    surface(reference)
    if matex.rank() == 0:
        a, b = science.read_surface(path), science.read_surface(reference)
        with open(sys.argv[3], "w") as f:
            json.dump({"computed_on_resume": computed, "resumed": a["loss"].tolist(),
                       "reference": b["loss"].tolist(),
                       "d1_equal": all(np.array_equal(p, q) for p, q in zip(a["d1"], b["d1"])),
                       "d2_equal": all(np.array_equal(p, q) for p, q in zip(a["d2"], b["d2"]))},
                      f)
