"""matex.hpo.minimize on 4 ranks: analytic functions, bad inputs, resume; one JSON per rank.

    mpiexec -n 4 python tests/scripts/hpo_minimize.py OUT WORKDIR [oracle ...]
"""

import json
import math
import os
import sys
import traceback

import keras_tuner as kt
import numpy as np
from mpi4py import MPI

from matex import hpo

out, work = sys.argv[1], sys.argv[2]
oracles = sys.argv[3:] or ["random"]
world = MPI.COMM_WORLD
rank = world.Get_rank()
record = {}


def branin_space():
    space = kt.HyperParameters()
    space.Float("x1", -5.0, 10.0)
    space.Float("x2", 0.0, 15.0)
    return space


def branin(x1, x2):
    a, b, c = 1.0, 5.1 / (4 * math.pi ** 2), 5 / math.pi
    return (a * (x2 - b * x1 ** 2 + c * x1 - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi))
            * math.cos(x1) + 10)


HART_A = np.array([[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14],
                   [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]])
HART_P = 1e-4 * np.array([[1312, 1696, 5569, 124, 8283, 5886],
                          [2329, 4135, 8307, 3736, 1004, 9991],
                          [2348, 1451, 3522, 2883, 3047, 6650],
                          [4047, 8828, 8732, 5743, 1091, 381]])
HART_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])


def hartmann6(x):
    x = np.asarray(x)
    return float(-np.sum(HART_ALPHA * np.exp(-np.sum(HART_A * (x - HART_P) ** 2, axis=1))))


calls = []


def branin_fn(hp, comm):
    # split the work over the group: each rank adds its share, one allreduce
    terms = [branin(hp["x1"], hp["x2"]) if comm.Get_rank() == 0 else 0.0]
    value = comm.allreduce(sum(terms))
    calls.append({"x": [hp["x1"], hp["x2"]], "size": comm.Get_size(), "value": value,
                  "group_rank": comm.Get_rank()})
    return value


def run(name, action):
    try:
        record[name] = action()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        record[name] = {"error": type(exc).__name__, "message": str(exc),
                        "traceback": traceback.format_exc()}


def search(k, oracle="random", trials=30, **kw):
    del calls[:]
    best, value = hpo.minimize(branin_fn, branin_space(), oracle=oracle, max_trials=trials,
                               ranks_per_trial=k, seed=1, **kw)
    return {"best": best.values, "value": value, "calls": list(calls)}


for oracle in oracles:
    for k in (1, 2):
        run("branin-%s-k%d" % (oracle, k), lambda: search(k, oracle))

    def hartmann():
        space = kt.HyperParameters()
        for i in range(6):
            space.Float("x%d" % i, 0.0, 1.0)
        best, value = hpo.minimize(lambda hp, comm: hartmann6([hp["x%d" % i] for i in range(6)]),
                                   space, oracle=oracle, max_trials=40, ranks_per_trial=1, seed=2)
        return {"best": best.values, "value": value}

    run("hartmann-%s" % oracle, hartmann)

# ---- bad inputs -----------------------------------------------------------------------
run("k-does-not-divide", lambda: search(3))
run("empty-space", lambda: hpo.minimize(branin_fn, kt.HyperParameters(), oracle="random"))


def failing_fn(hp, comm):
    # rank 1 raises while rank 0 waits for it in the allreduce (released, not hung)
    if hp["x1"] > 2.5 and comm.Get_rank() == 1:
        raise ArithmeticError("boom in trial at x1=%.3f" % hp["x1"])
    return branin_fn(hp, comm)


def failing():
    directory = os.path.join(work, "failing")
    best, value = hpo.minimize(failing_fn, branin_space(), oracle="random", max_trials=10,
                               ranks_per_trial=2, seed=5, directory=directory, overwrite=True)
    trials = {}
    for name in sorted(os.listdir(os.path.join(directory, "minimize"))):
        path = os.path.join(directory, "minimize", name, "trial.json")
        if os.path.exists(path):
            state = json.load(open(path))
            trials[state["trial_id"]] = {"status": state["status"], "message": state["message"],
                                         "x1": state["hyperparameters"]["values"]["x1"]}
    return {"best": best.values, "value": value, "trials": trials}


run("fn-raises-on-one-rank", failing)


def other_search():
    directory = os.path.join(work, "taken")
    hpo.minimize(branin_fn, branin_space(), oracle="random", max_trials=2, seed=0,
                 directory=directory, overwrite=True)
    space = kt.HyperParameters()
    space.Int("layers", 1, 4)   # same directory, another space
    return hpo.minimize(lambda hp, comm: float(hp["layers"]), space, oracle="random",
                        max_trials=2, directory=directory)


run("directory-of-another-search", other_search)


def resume():
    directory = os.path.join(work, "resume")
    first = search(1, trials=4, directory=directory, overwrite=True)
    second = search(1, trials=8, directory=directory)   # overwrite=False: continue
    return {"first": first, "second": second}


run("resume", resume)


def always_fails(hp, comm):
    raise ArithmeticError("nothing works")


def oracle_gives_up():
    # Keras Tuner's oracle raises on the owner after 2 failures in a row (its lock stays
    # held): the search ends with that error on every rank
    oracle = kt.oracles.RandomSearchOracle(objective=kt.Objective("value", "min"),
                                           max_trials=12, seed=0,
                                           max_consecutive_failed_trials=2)
    return hpo.minimize(always_fails, branin_space(), oracle=oracle, ranks_per_trial=1)


run("oracle-gives-up", oracle_gives_up)


class BrokenOracle(kt.oracles.RandomSearchOracle):
    """Raises when asked for its 4th trial (inside Keras Tuner's synchronized create_trial)."""

    def populate_space(self, trial_id):
        if len(self.trials) >= 3:
            raise LookupError("no more points in this oracle")
        return super().populate_space(trial_id)


def oracle_raises():
    # the group leader that asks gets no trial: its peer must not wait in the broadcast
    oracle = BrokenOracle(objective=kt.Objective("value", "min"), max_trials=12, seed=0)
    return hpo.minimize(branin_fn, branin_space(), oracle=oracle, ranks_per_trial=2)


run("oracle-raises", oracle_raises)
record["world_rank"] = rank
with open("%s.%d.json" % (out, rank), "w") as f:
    json.dump(record, f)
