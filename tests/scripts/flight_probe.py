"""Collectives on the NumPy core (no TensorFlow: quick) that go wrong on purpose.

    python flight_probe.py MODE

* ``mismatch``: 4 agreeing allreduces, then rank 2 reduces a float32[5] while the
  others reduce a float32[4] (the agreement check fails on every rank); exit 0.
* ``sleep``: ranks 0 and 1 run 2 allreduces on a sub-communicator of theirs, then
  rank 1 sleeps 5 s before the 4th collective on the world, the others wait in it
  (their process-wide counts differ: only the world's count may name the late rank).
* ``skip``: rank 1 skips the 4th collective and then sleeps 30 s (the others wait
  until MATEX_STALL_ABORT_S ends the job).
* ``usr1``: ranks 0 and 1 run 5 allreduces of float32[2] on a sub-communicator of
  theirs, all run a 4th on the world; then every rank sends itself SIGUSR1 and
  waits for its dump to appear.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from matex import _config, _runtime


def collective(core, n=4):
    return core.allreduce(np.ones(n, np.float32), "float32", "sum")


def main(mode):
    core = _runtime._core()
    rank = _runtime.rank()
    for _ in range(3):
        collective(core)
    if mode == "mismatch":
        collective(core)
        try:
            collective(core, 5 if rank == 2 else 4)
        except core.MismatchError as exc:
            print("rank %d: mismatch: %s" % (rank, exc), flush=True)
    elif mode == "sleep":
        sub_collectives(core, rank, (0, 1), 2)
        if rank == 1:
            time.sleep(5)   # the stall inspector must find this line
        collective(core)
        print("rank %d: done" % rank, flush=True)
    elif mode == "skip":
        if rank != 1:
            collective(core)
        else:
            time.sleep(30)   # never arrives
    elif mode == "usr1":
        sub_collectives(core, rank, (0, 1), 5)
        collective(core)
        path = Path(_config.flight_dir()) / ("rank%d.json" % _config.launched_rank())
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 20
        while not path.exists() and time.time() < deadline:
            time.sleep(0.1)
        print("rank %d: dumped %s" % (rank, path.exists()), flush=True)
        _runtime.comm().Barrier()


def sub_collectives(core, rank, members, n):
    """Ranks in ``members`` run ``n`` allreduces of float32[2] on a sub-communicator of
    their own; the others make theirs (the split is collective) and run none on it."""
    sub = _runtime.comm().Split(0 if rank in members else 1, rank)
    slot = _runtime.register_comm(sub)
    if rank in members:
        for _ in range(n):
            core.allreduce(np.ones(2, np.float32), "float32", "sum", comm=slot)


if __name__ == "__main__":
    main(sys.argv[1])
