"""Fewer synchronisations under real ``mpiexec --with-ft ulfm``: a rank dies mid-training.

3 ranks, 20 steps; rank 2 is killed at step 14, inside the step.

* LocalSGD and DiLoCo, sync_every=4 (the last sync was after step 12): the
  survivors must roll back to step 12 (it is begun again).
* ``delay=1``: step 13's non-blocking allreduce is in flight when rank 2
  dies; the survivors drop it (that one averaged update is never applied)
  and redo step 14 only (no rollback), with nothing pending from before.

Either way they finish all 20 steps on 2 ranks with identical states and have
trained on every sample exactly once per epoch.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

import mpitools
from matex import launcher as launch

TIER = "ulfm"
SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "ft_localsgd.py")


@pytest.mark.parametrize("method", ["localsgd", "diloco", "delay"])
def test_survivors_roll_back_to_the_last_sync_and_finish(tmp_path, method):
    out = str(tmp_path / "r")
    env = launch.launch_env()
    env.update(TF_CPP_MIN_LOG_LEVEL="2", MATEX_INJECT_FAULT="rank=2,step=14,kind=kill",
               MATEX_FLIGHT_DIR=str(tmp_path / "flight"))
    cmd = launch.mpiexec_command(3, [sys.executable, "-m", "matex", SCRIPT, out, method],
                                 mpi_args=["-x", "MATEX_INJECT_FAULT", "-x", "MATEX_FLIGHT_DIR"]
                                 + launch.ft_mpi_args())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        stdout, err = proc.communicate()
        raise AssertionError("hung\n" + stdout[-2000:] + err[-4000:])
    assert proc.returncode == 0, stdout[-2000:] + err[-4000:]
    results = {int(p.rsplit(".", 1)[1]): json.load(open(p)) for p in glob.glob(out + ".[0-9]*")}
    assert sorted(results) == [0, 1], err[-4000:]
    assert len({r["digest"] for r in results.values()}) == 1, "survivors' states differ"
    assert len({r["own_digest"] for r in results.values()}) == 1
    for r in results.values():
        # delay=1: matex.flush's apply of the last gradient counts one more
        assert r["size"] == 2 and r["iterations"] == (21 if method == "delay" else 20)
        assert [x["new_size"] for x in r["recoveries"]] == [2]
        assert r["seen"] == [2.0] * 300, "a sample was lost or trained twice"
        begun = r["steps_begun"]
        if method == "delay":
            # step 14 redone, nothing before it; the last step's gradient still in flight
            assert begun == list(range(15)) + list(range(14, 20)), begun
            assert r["flushed"] is True
            assert r["recoveries"][0]["pending"] is False, "the update in flight was kept"
            continue
        # rolled back: step 12 (first after the last sync) begun again after step 14
        assert begun.count(12) == 2 and begun.index(14) < len(begun) - 1 - begun[::-1].index(12)
        assert begun[-1] == 19
