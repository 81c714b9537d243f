"""Horovod's elastic API on MaTEx (#25 item 6): ``hvd.elastic.run`` and its states.

* A rank killed inside a step under ``matexrun --ft --horovod``
  (tests/scripts/elastic_loop.py, written for Horovod): the survivors restore
  to the last commit, synchronise, and run ``train`` again; every committed
  step counted once, every sample trained on once per epoch, replicas equal.
* A whole host lost with its Open MPI daemon (which ULFM cannot survive,
  open-mpi/ompi #13215), on network-namespace hosts: ``matexrun --ft --elastic
  --host-discovery-script`` restarts the job on the host that is left, from
  the last commit written to disk (tests/scripts/elastic_hosts.py).
* ``matexrun --elastic``'s planning without a launch: the discovery script's
  output, ``--min-np``/``--max-np``.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
MATEXRUN = os.path.join(os.path.dirname(sys.executable), "matexrun")


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra or {})
    return env


def _reports(prefix):
    return {int(p.name.rsplit(".", 1)[1]): json.loads(p.read_text())
            for p in Path(prefix).parent.glob(Path(prefix).name + ".[0-9]*")}


PER_EPOCH, EPOCHS = 4, 2


def test_survivors_restore_the_last_commit_and_run_again(tmp_path):
    """3 ranks, rank 1 killed inside step 5 (before its gradient allreduce)."""
    out = tmp_path / "r"
    proc = subprocess.run([MATEXRUN, "--ft", "--horovod", "-n", "3", "--inject-fault",
                           "rank=1,step=5,kind=kill", str(SCRIPTS / "elastic_loop.py"),
                           str(out), str(PER_EPOCH), str(EPOCHS)],
                          capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=tmp_path)
    err = proc.stderr[-4000:]
    assert proc.returncode == 0, err
    done = _reports(out)
    assert sorted(done) == [0, 2], err
    steps = PER_EPOCH * EPOCHS
    assert len({rep["digest"] for rep in done.values()}) == 1, "survivors' states differ"
    for rep in done.values():
        assert rep["size"] == 2 and rep["resets"] == [2], rep
        # every committed step counted once: the optimizer's counter was restored
        assert rep["returned"] == rep["batch"] == rep["iterations"] == steps, rep
        assert rep["seen"] == [float(EPOCHS)] * (PER_EPOCH * 12), "a sample lost or repeated"
        # steps 0-4 committed on 3 ranks; step 5 redone by the 2 survivors
        assert rep["sizes"] == [3] * 5 + [2] * (steps - 5), rep["sizes"]
