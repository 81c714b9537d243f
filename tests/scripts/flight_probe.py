"""Collectives on the NumPy core (no TensorFlow: quick) that go wrong on purpose.

    python flight_probe.py MODE

* ``mismatch``: 4 agreeing allreduces, then rank 2 reduces a float32[5] while the
  others reduce a float32[4] (the agreement check fails on every rank); exit 0.
* ``sleep``: rank 1 sleeps 5 s before the 4th collective, the others wait in it.
* ``skip``: rank 1 skips the 4th collective and then sleeps 30 s (the others wait
  until MATEX_STALL_ABORT_S ends the job).
* ``usr1``: every rank sends itself SIGUSR1 and waits for its dump to appear.
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
        path = Path(_config.flight_dir()) / ("rank%d.json" % _config.launched_rank())
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 20
        while not path.exists() and time.time() < deadline:
            time.sleep(0.1)
        print("rank %d: dumped %s" % (rank, path.exists()), flush=True)
        _runtime.comm().Barrier()


if __name__ == "__main__":
    main(sys.argv[1])
