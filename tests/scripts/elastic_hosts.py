"""Test script: elastic training whose state is plain objects, across the loss of a host.

Usage: matexrun --ft --elastic ... elastic_hosts.py OUT STEPS

``matex.horovod.elastic.run`` runs ``train(state)``; ``state`` is an
``ObjectState`` with ``step`` (steps committed) and ``log`` (one entry per
committed step: the step, the number of ranks, and the sum of their ranks
allreduced, so a step of a broken communicator cannot pass unnoticed). Each
step sleeps 0.1 s (time for the test to kill a host mid-training), commits,
and rank 0 writes OUT.progress (the step count). Every rank that finishes
writes OUT.<world rank> (JSON) with the step it started from in this launch.
No TensorFlow: the node-loss test restarts jobs, and TensorFlow's import is
the slow part of a start.
"""

import json
import os
import socket
import sys
import time

import matex
from matex.horovod import elastic

out, steps = sys.argv[1], int(sys.argv[2])
state = elastic.ObjectState(step=0, log=[])
started = []


def write(path, data):
    with open(path + ".incoming", "w") as f:
        json.dump(data, f)
    os.replace(path + ".incoming", path)


@elastic.run
def train(state):
    if not started:
        started.append(state.step)   # where this launch began: 0, or a commit from disk
    while state.step < steps:
        comm = matex.comm()
        ranks = comm.allreduce(comm.Get_rank())
        time.sleep(0.1)
        state.log = state.log + [[state.step, comm.Get_size(), ranks]]
        state.step += 1
        state.commit()
        if comm.Get_rank() == 0:
            write(out + ".progress", {"step": state.step})
    return state.step


done = train(state)
write("%s.%s" % (out, os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
      {"returned": done, "started": started[0], "log": state.log, "size": matex.size(),
       "hostname": socket.gethostname()})
