"""Test script: Horovod process sets across a rank loss under ULFM (``matexrun --ft``).

Usage: ft_process_sets.py OUT STEPS. On 4 ranks: set A = world ranks [0, 1, 2],
set B = [2, 3]. Every step (under ``matex.run_resilient``) each member sums,
gathers objects and checks its rank in each of its sets against the members
alive at that time, and A's members also run a ``tf.function`` traced before any
failure. ``FT_KILL="WORLD_RANK:STEP"`` kills that rank at the start of that step,
so its set's peers meet the failure inside the set's collective (and B's members
wait on a peer that went on to recover). The report lists every mismatch.
"""

import json
import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf
from mpi4py import MPI

import matex
import matex.horovod.tensorflow as hvd

out, steps = sys.argv[1], int(sys.argv[2])
WORLD = MPI.COMM_WORLD.Get_rank()
KILL = tuple(int(v) for v in os.environ.get("FT_KILL", "-1:-1").split(":"))
hvd.init()
MEMBERS = {"A": [0, 1, 2], "B": [2, 3]}   # MPI_COMM_WORLD ranks (= global ranks at start)
sets = {name: hvd.add_process_set(ranks) for name, ranks in MEMBERS.items()}
w = tf.Variable([0.0])
optimizer = matex.DistributedOptimizer(keras.optimizers.SGD(0.1), op="sum")
optimizer.build([w])
traced = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=sets["A"]))
mismatches = []


def expect(i, what, got, want):
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        mismatches.append("step %d size %d %s: %r != %r" % (i, matex.size(), what, got, want))


def step(i):
    if (WORLD, i) == KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    comm = matex.comm()
    alive = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                      MPI.COMM_WORLD.Get_group())   # world rank of each rank
    expect(i, "global ranks", hvd.global_process_set.ranks, list(range(len(alive))))
    for name in ("A", "B"):
        ps = sets[name]
        members = [r for r in MEMBERS[name] if r in alive]
        # renumbered as the global ranks are: the survivors' new global ranks
        expect(i, name + " ranks", ps.ranks, [alive.index(r) for r in members])
        if WORLD not in members:
            continue
        got = hvd.allreduce(tf.constant([float(WORLD + i)]), op=hvd.Sum, process_set=ps)
        expect(i, name + " sum", got.numpy(), [float(sum(r + i for r in members))])
        expect(i, name + " objects", hvd.allgather_object(WORLD, process_set=ps), members)
        expect(i, name + " rank/size", (ps.rank(), ps.size()),
               (members.index(WORLD), len(members)))
        if name == "A":   # a function traced at step 0 names the slot, which now holds the
            expect(i, "A traced", traced(tf.constant([1.0])).numpy(),   # survivors' comm
                   [float(len(members))])
    optimizer.apply([tf.constant([1.0])], [w])


recoveries = matex.run_resilient(step, steps, [w] + optimizer.variables, optimizer)
with open("%s.%d" % (out, WORLD), "w") as f:
    json.dump({"mismatches": mismatches, "size": matex.size(), "recoveries": recoveries,
               "iterations": int(optimizer.iterations), "w": w.numpy().tolist(),
               "ranks": {name: ps.ranks for name, ps in sets.items()},
               "traces": traced.experimental_get_tracing_count()}, f)
