"""TF1 graph code (tf.compat.v1 Sessions) on MaTEx, under real mpiexec: Horovod's TF1 API
(tests/mpi/test_legacy_tf1.py), an unmodified plain TF1 script under ``python -m matex``
(tests/scripts/tf1_plain.py), and a rank failing inside Session.run."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import mpitools

ROOT = mpitools.ROOT
PLAIN = str(ROOT / "tests" / "scripts" / "tf1_plain.py")
HOROVOD = str(ROOT / "tests" / "scripts" / "tf1_horovod.py")


@pytest.mark.parametrize("nranks", [2, 3])
def test_horovod_tf1_suite(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_legacy_tf1.py"], tmp_path, timeout=600) >= 9


def _results(out, ranks):
    return [json.load(open("%s.%d" % (out, r))) for r in ranks]


@pytest.mark.parametrize("nranks", [2, 3])
def test_unmodified_tf1_script_matches_one_process(nranks, tmp_path):
    """GradientDescent (minimize), Adam (compute, clip, apply) and Momentum (tf.gradients,
    apply) on batches of 7 rows (3 ranks: 2, 2 and 3 rows, weighted by rows): every
    variable and slot equal on every rank and to one process, and the evaluation run over
    all rows (not split: no training in it) equal to one process's on every rank."""
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    subprocess.run([sys.executable, PLAIN, one], check=True, timeout=900, capture_output=True,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", PLAIN, many], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    alone, = _results(one, [0])
    ranks = _results(many, range(nranks))
    for result in ranks:
        assert result["variables"] == ranks[0]["variables"]   # bitwise, on every rank
        assert set(result["variables"]) == set(alone["variables"])
        for name, value in alone["variables"].items():
            np.testing.assert_allclose(result["variables"][name], value, rtol=1e-4,
                                       atol=1e-5, err_msg=name)
        np.testing.assert_allclose(result["evaluation"], alone["evaluation"], rtol=1e-5)
    assert alone["evaluation"][0] < alone["losses"][0][0]   # it trained


@pytest.mark.parametrize("nranks", [2, 3])
def test_horovod_tf1_script_matches_one_process(nranks, tmp_path):
    """Issue 31's Horovod TF1 script under python -m matex --horovod: DistributedOptimizer
    over v1 Adam, hvd.broadcast_global_variables(0) run alone after the initialiser (nothing
    fed), a feed_dict loop; then MonitoredTrainingSession with BroadcastGlobalVariablesHook.
    Both: every variable equal on every rank and to one process; the Session loop's
    hvd.allreduce'd losses equal to one process's."""
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    subprocess.run([sys.executable, "-m", "matex", "--horovod", HOROVOD, one], check=True,
                   timeout=900, capture_output=True,   # (may build the ops first)
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", "--horovod", HOROVOD,
                                     many], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    alone, = _results(one, [0])
    ranks = _results(many, range(nranks))
    np.testing.assert_allclose(ranks[0]["session"]["losses"], alone["session"]["losses"],
                               rtol=1e-5)
    for part in ("session", "monitored"):
        for result in ranks:
            assert result[part]["variables"] == ranks[0][part]["variables"], part
            assert set(result[part]["variables"]) == set(alone[part]["variables"])
            for name, value in alone[part]["variables"].items():
                np.testing.assert_allclose(result[part]["variables"][name], value, rtol=1e-4,
                                           atol=1e-5, err_msg="%s %s" % (part, name))
    assert alone["session"]["losses"][-1] < alone["session"]["losses"][0]


def test_a_rank_failing_inside_session_run_ends_every_rank(tmp_path):
    """Rank 1 feeds a wrong shape at step 3: every rank ends, with the error, no hang."""
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", PLAIN, str(tmp_path / "x"),
                                "raise"], timeout=300)
    assert proc.returncode != 0
    assert "Cannot feed value of shape" in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.glob("x.*"))   # no rank finished training


def test_under_ft_a_rank_lost_inside_session_run_stops_every_rank_clearly(tmp_path):
    """matexrun --ft (ULFM), 3 ranks: rank 1 SIGKILLs itself at step 3. TF1 Sessions are
    not recovered: both survivors stop with RankLostInSession, matexrun exits 1."""
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    proc = subprocess.Popen([matexrun, "--ft", "-n", "3", PLAIN, str(tmp_path / "x"), "kill"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the whole job, ranks included
        _, err = proc.communicate()
        raise AssertionError("hung: killed after 300 s\n" + err[-3000:])
    assert proc.returncode == 1, err[-3000:]
    assert err.count("RankLostInSession: matex --ft: a rank was lost during a TF1 "
                     "Session.run") == 2, err[-3000:]
    assert "every rank failed (3 of 3)" in err
    assert not list(tmp_path.glob("x.*"))
