"""Distributed search over a plain function: ``matex.hpo.minimize``.

    mpiexec -n 4 python examples/tune_minimize.py            # 2 trials at a time
    matexrun -n 4 examples/tune_minimize.py

Rank 0 prints the best point found, e.g.
``best x1=3.1416 x2=2.2750: 0.39789 (the optimum is 0.39789)``; ``--trials``
sets the budget (default 40).

``fn(hp, comm)`` runs on every rank of a group (here ``ranks_per_trial=2``:
two groups of two); ``comm`` is the group's mpi4py communicator, so a trial
can split its own work. The answer is the same on every rank.
"""

import argparse
import math

import keras_tuner as kt

from matex import hpo


def branin(hp, comm):
    x1, x2 = hp["x1"], hp["x2"]
    # each rank of the group computes one of the two terms; one allreduce adds them
    if comm.Get_rank() == 0:
        part = (x2 - 5.1 / (4 * math.pi ** 2) * x1 ** 2 + 5 / math.pi * x1 - 6) ** 2
    else:
        part = 10 * (1 - 1 / (8 * math.pi)) * math.cos(x1) + 10
    return comm.allreduce(part) if comm.Get_size() > 1 else part + (
        10 * (1 - 1 / (8 * math.pi)) * math.cos(x1) + 10)


parser = argparse.ArgumentParser(description="matex.hpo.minimize on the Branin function")
parser.add_argument("--trials", type=int, default=40, help="function evaluations")
args = parser.parse_args()
space = kt.HyperParameters()
space.Float("x1", -5.0, 10.0)
space.Float("x2", 0.0, 15.0)
oracle = "lazy-gp"
try:
    hpo.LazyBayesianOracle   # noqa: B018 - MaTEx's GP oracle, when installed
except (ImportError, AttributeError):
    oracle = "random"
best, value = hpo.minimize(branin, space, oracle=oracle, max_trials=args.trials, ranks_per_trial=2,
                           seed=0)
from mpi4py import MPI  # noqa: E402 - print once

if MPI.COMM_WORLD.Get_rank() == 0:
    print("best x1=%.4f x2=%.4f: %.5f (the optimum is 0.39789)" % (best["x1"], best["x2"], value))
