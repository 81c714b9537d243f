"""Chaos workload: a small ``matex.hpo.minimize`` search (Branin, random oracle) on groups.

A trial waits a little (so kills fall inside trials too) and then sums Branin over its
group: the group's rank 0 contributes the value, the others 0.0, one allreduce on the
``comm`` minimize hands it, so a trial's value is Branin's exactly whatever the group's
size. Records the search in OUT.search (the tuner directory) and writes OUT.<world rank>
(JSON: the best hyperparameters and value this rank got, and every call it made) on
every rank that finishes.

Usage: chaos_search.py OUT TRIALS RANKS_PER_TRIAL [RANK]

RANK (a deterministic kill, for a regression test): that world rank SIGKILLs itself
just before ``minimize``.
"""

import json
import math
import os
import signal
import sys
import time

import keras_tuner as kt

from matex import hpo

out, trials, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
calls = []


def branin(x1, x2):
    a, b, c = 1.0, 5.1 / (4 * math.pi ** 2), 5 / math.pi
    return (a * (x2 - b * x1 ** 2 + c * x1 - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi))
            * math.cos(x1) + 10)


def fn(hp, comm):
    time.sleep(0.3)
    value = comm.allreduce(branin(hp["x1"], hp["x2"]) if comm.Get_rank() == 0 else 0.0)
    calls.append({"hp": hp.values, "size": comm.Get_size(), "value": value})
    return value


rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if len(sys.argv) > 4 and int(sys.argv[4]) == rank:
    os.kill(os.getpid(), signal.SIGKILL)
space = kt.HyperParameters()
space.Float("x1", -5.0, 10.0)
space.Float("x2", 0.0, 15.0)
best, value = hpo.minimize(fn, space, oracle="random", max_trials=trials, ranks_per_trial=k,
                           seed=1, directory=out + ".search", overwrite=True)

import matex  # noqa: E402  (for the report only)

with open("%s.%d" % (out, rank), "w") as f:
    json.dump({"best": best.values, "value": value, "calls": calls, "size": matex.size()}, f)
