"""Chaos workload: a ``PipelineModel`` (one stage per launched rank) trained with ``fit``,
then ``predict``.

Under ULFM a lost stage cannot be recovered (its weights exist nowhere else): the
promise is ``matex.errors.RankFailure`` naming the lost rank(s) on every survivor,
never a hang. Every rank that gets that far writes OUT.<world rank> (JSON):
``{"outcome": "finished", ...the complete result...}`` or ``{"outcome": "RankFailure",
"message": ...}``; any other exception propagates (and no file is written).

Usage: chaos_pipeline.py OUT EPOCHS [RANK:WHERE]

RANK:WHERE (a deterministic kill, for a regression test): world rank RANK SIGKILLs
itself just before ``PipelineModel(...)`` (WHERE = ``construct``) or just before
``pm.fit`` (``fit``).
"""

import json
import os
import signal
import sys

import keras
import numpy as np

import matex
from matex.errors import RankFailure
from matex.parallel import PipelineModel, StageBoundary

out, epochs = sys.argv[1], int(sys.argv[2])
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
stages = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
die_rank, die_where = (sys.argv[3].split(":") if len(sys.argv) > 3 else ("-1", ""))
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype("float32")
y = np.stack([x[:, :2].sum(1), x[:, 2:].prod(1)], 1).astype("float32")


def report(result):
    with open("%s.%d" % (out, rank), "w") as f:
        json.dump(result, f)


def die_at(where):
    if rank == int(die_rank) and where == die_where:
        os.kill(os.getpid(), signal.SIGKILL)


try:
    layers = [keras.Input((4,))]
    for _ in range(stages - 1):
        layers += [keras.layers.Dense(8, activation="relu"), StageBoundary()]
    model = keras.Sequential(layers + [keras.layers.Dense(2)])
    die_at("construct")
    pm = PipelineModel(model, microbatches=2)
    pm.compile(optimizer="sgd", loss="mse")
    die_at("fit")
    history = pm.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    predictions = pm.predict(x, batch_size=64, verbose=0)
except RankFailure as exc:
    report({"outcome": "RankFailure", "message": str(exc), "size": matex.size()})
    sys.exit(0)
report({"outcome": "finished", "loss": [float(v) for v in history.history["loss"]],
        "predict": np.asarray(predictions, "float64").tolist(), "size": matex.size()})
