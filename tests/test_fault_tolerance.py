"""Fault tolerance under real `mpiexec --with-ft ulfm`: ranks die, survivors finish.

Every run trains the same model (tests/scripts/ft_fit.py: 300 samples, global
batch 32 -> 10 steps per epoch, 3 epochs = 30 steps) and checks: the job exits
0; every survivor finished all steps on a communicator of the expected size;
survivors' model+optimizer digests are identical; every sample was trained on
exactly once per epoch (counted inside the model); accuracy close to a
fault-free run; bounded time.
"""

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mpitools
from matex import launcher as launch

SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "ft_fit.py")
STEPS, EPOCHS, N = 10, 3, 300
SHM_SEGMENTS = "/dev/shm/sm_segment.*"   # Open MPI's shared-memory transport files


def _segments_left_behind(before):
    """Shared-memory segments made since ``before`` that no live process maps: a job
    running beside this one (``make test`` runs two workers) maps its own."""
    def unused():
        mapped = set()
        for maps in glob.glob("/proc/[0-9]*/maps"):
            try:
                with open(maps) as f:
                    mapped.update(line.split()[-1] for line in f if "sm_segment." in line)
            except OSError:
                pass   # a process that ended while we looked
        return set(glob.glob(SHM_SEGMENTS)) - before - mapped
    left = unused()
    if left:   # another job's may be between its unmap and its unlink: look again
        time.sleep(1)
        left &= unused()
    return left


def _launch(tmp_path, nranks, faults=None, ft=True, extra=(), env_vars=None):
    out = str(tmp_path / "r")
    env = launch.launch_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    mpi_args = launch.ft_mpi_args() if ft else []
    if faults:
        env["MATEX_INJECT_FAULT"] = faults
        mpi_args = ["-x", "MATEX_INJECT_FAULT"] + mpi_args
    for name, value in (env_vars or {}).items():
        env[name] = value
        mpi_args = ["-x", name] + mpi_args
    cmd = launch.mpiexec_command(nranks, [sys.executable, "-m", "matex", SCRIPT, out, str(N),
                                          "32", str(EPOCHS)] + list(extra), mpi_args=mpi_args)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, out


def _failed_ranks_text(err):
    """Each failed rank's whole report, by rank: the lines a rank that raised printed
    (``[rank N] ...``, its full traceback, chained exceptions included) before dying.

    A rank lost besides the victim (a survivor that did not recover) shows here with
    the error that ended it, however long, wherever it lies in stderr.
    """
    by_rank = {}
    for line in err.splitlines():
        match = re.match(r"\[rank (\d+)\] ", line)
        if match:
            by_rank.setdefault(int(match.group(1)), []).append(line)
    return "".join("--- rank %d printed before it died ---\n%s\n" % (rank, "\n".join(lines))
                   for rank, lines in sorted(by_rank.items()))


def _tail(err):
    """What a failure message shows of stderr: every MaTEx/MPI event, each failed
    rank's whole traceback, then the end."""
    events = [line for line in err.splitlines()
              if "matex:" in line or "MPI_ERR" in line or "prte" in line.lower()]
    return "events:\n%s\nfailed ranks:\n%s...\n%s" % (
        "\n".join(events[-60:]), _failed_ranks_text(err) or "(none printed)\n", err[-3000:])


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError("hung: killed after %d s\n%s\n%s" % (timeout, out[-2000:], _tail(err)))
    return out, err


def _results(out):
    return {int(p.rsplit(".", 1)[1]): json.load(open(p)) for p in glob.glob(out + ".[0-9]*")}


def _check(results, survivors, out, err, reference=None, size=None):
    """``size``: the communicator size survivors end on (default: one per survivor)."""
    assert sorted(results) == sorted(survivors), (sorted(results), _tail(err))
    digests = {r["digest"] for r in results.values()}
    assert len(digests) == 1, ("survivors' states differ", _tail(err))
    for r in results.values():
        if r["recoveries"]:   # the communicators before the failure were freed
            assert r["freed"] == [True, True], (r["freed"], _tail(err))
        assert r["size"] == (len(survivors) if size is None else size), (r["size"], _tail(err))
        assert r["iterations"] == STEPS * EPOCHS, (r["iterations"], _tail(err))
        assert r["seen"] == [float(EPOCHS)] * N, ("a sample was lost or trained twice",
                                                  _tail(err))
    if reference is not None:
        acc = next(iter(results.values()))["accuracy"]
        assert abs(acc - reference) <= 0.05, (acc, reference)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fault-free")
    proc, out = _launch(tmp, 4)
    stdout, err = _finish(proc)
    assert proc.returncode == 0, _tail(err)
    assert "fault tolerance: ULFM shrink-and-continue" in stdout
    results = _results(out)
    _check(results, [0, 1, 2, 3], out, err)
    return next(iter(results.values()))["accuracy"]


@pytest.mark.parametrize("faults,survivors", [
    ("rank=2,step=14,kind=kill", [0, 1, 3]),                       # middle rank, mid-epoch
    ("rank=0,step=0,kind=kill", [1, 2, 3]),                        # rank 0, first step
    ("rank=3,step=20,kind=exception", [0, 1, 2]),                  # last rank, at an epoch boundary
    ("rank=1,step=7,kind=hang", [0, 2, 3]),                        # silent rank: failure detector
    ("rank=1,step=9,kind=kill;rank=2,step=9,kind=kill", [0, 3]),   # two at once
    ("rank=0,step=5,kind=kill;rank=1,step=15,kind=exception;rank=3,step=25,kind=kill", [2]),
    ("rank=3,step=29,kind=kill", [0, 1, 2]),                       # last step
    ("rank=2,step=10,kind=kill,at=begin", [0, 1, 3]),              # before the forward pass
    ("rank=1,step=0,kind=kill,at=start", [0, 2, 3]),               # during MaTEx's start-up
    # while the first step is traced, before the optimizer's first-step broadcast
    ("rank=1,step=0,kind=kill,at=build", [0, 2, 3]),
    ("rank=2,step=30,kind=kill,at=evaluate", [0, 1, 3]),           # in evaluate, after fit
    # in fit's validation pass, after the first epoch (Keras hands evaluate a CallbackList)
    ("rank=2,step=10,kind=kill,at=evaluate;validate", [0, 1, 3]),
    ("rank=1,step=20,kind=exception,at=evaluate;validate", [0, 2, 3]),
    # a repeated tf.data dataset with steps_per_epoch: resumed mid-epoch in its stream
    ("rank=2,step=14,kind=kill;repeat", [0, 1, 3]),
    ("rank=3,step=10,kind=hang,at=evaluate;validate", [0, 1, 2]),
], ids=["kill-middle-mid", "kill-rank0-first", "exception-last-boundary", "hang-middle",
        "two-at-once", "down-to-one", "kill-last-step", "kill-at-begin", "kill-at-start",
        "kill-while-first-step-traced",
        "kill-in-evaluate", "kill-in-validation", "exception-in-validation",
        "hang-in-validation", "kill-mid-epoch-steps-per-epoch"])
def test_survivors_finish_with_nothing_lost_or_repeated(tmp_path, fault_free, faults,
                                                        survivors):
    modes = [m for m in ("validate", "repeat") if faults.endswith(";" + m)]
    faults = faults.replace(";validate", "").replace(";repeat", "")
    validate = "validate" in modes
    proc, out = _launch(tmp_path, 4, faults, extra=modes)
    stdout, err = _finish(proc)
    # survivors exit 0; a failed rank (killed, hung or raising) ends as a crash
    assert proc.returncode == 0, _tail(err)
    assert err.count("matex: injecting fault") == faults.count("rank="), _tail(err)
    if "exception" in faults:
        assert "InjectedFault" in err and "the others continue without it" in err, _tail(err)
    if "at=start" in faults:
        assert "matex: rank(s) 1 failed during start-up; 3 rank(s) go on" in err, _tail(err)
    if "at=evaluate" in faults:   # evaluate is redone on the survivors, callbacks told
        lost = [int(faults.split("rank=")[1].split(",")[0])]
        for r in _results(out).values():
            assert [(x["lost"], x["new_size"]) for x in r["recoveries"]] == [(lost, 3)], \
                _tail(err)
            if validate:   # validation after every epoch, the interrupted one redone
                assert len(r["val_loss"]) == EPOCHS and all(np.isfinite(r["val_loss"])), \
                    (r["val_loss"], _tail(err))
    _check(_results(out), survivors, out, err, reference=fault_free)


def test_rank0_lost_entering_fit_then_checkpoints_under_ft_train_nothing_twice(tmp_path,
                                                                              fault_free):
    # Two failures, one launch, epoch checkpoints on (MATEX_CHECKPOINT_DIR) under --ft:
    # 1. rank 0, the root of fit's set-up broadcast (the shuffling seed), dies on
    #    entering fit: that broadcast ran before the recovery loop, every survivor died;
    # 2. world rank 1, rank 0 by then, dies while it writes the epoch-2 checkpoint
    #    (data written, not renamed). The survivors' state is newer than the epoch-1
    #    checkpoint: the redone fit must not restore it (it did: epoch 2 trained twice,
    #    and load_weights gave the optimizer's state to rank 0 only, replicas
    #    diverged, exit 0).
    proc, out = _launch(tmp_path, 4, "rank=0,step=0,kind=kill,at=fit;"
                        "rank=1,step=20,kind=kill,at=checkpoint",
                        env_vars={"MATEX_CHECKPOINT_DIR": str(tmp_path / "ckpt")})
    stdout, err = _finish(proc)
    assert proc.returncode == 0, _tail(err)
    assert err.count("matex: injecting fault") == 2, _tail(err)
    assert "resumed from the checkpoint" not in stdout, stdout
    results = _results(out)
    for r in results.values():
        assert [(x["lost"], x["new_size"]) for x in r["recoveries"]] == [([0], 3), ([0], 2)], \
            _tail(err)
    _check(results, [2, 3], out, err, reference=fault_free)


def test_kill_9_from_outside_at_a_random_moment(tmp_path, fault_free):
    proc, out = _launch(tmp_path, 4)
    deadline = time.time() + 180
    while (not os.path.exists(out + ".started") and time.time() < deadline
           and proc.poll() is None):
        time.sleep(0.05)
    if not os.path.exists(out + ".started"):
        stdout, err = _finish(proc)
        raise AssertionError("training never started (exit %s)\n%s" % (proc.returncode,
                                                                     _tail(err)))
    time.sleep(random.uniform(0.0, 1.5))
    victim = random.choice([0, 1, 2, 3])
    try:
        os.kill(int(open("%s.pid.%d" % (out, victim)).read()), signal.SIGKILL)
    except ProcessLookupError:   # the victim had already finished and exited: no kill,
        pass                     # every rank must then have finished on all 4 (below)
    stdout, err = _finish(proc)
    assert proc.returncode == 0, _tail(err)
    survivors = [r for r in range(4) if r != victim]
    results = _results(out)
    if all(r["size"] == 4 for r in results.values()):
        # The kill came after the victim's last collective (it may even have written
        # its result): the others never needed it, so nothing was recovered. Every
        # other rank must still have finished on the full communicator.
        _check(results, sorted(set(survivors) | set(results)), out, err,
               reference=fault_free, size=4)
        return
    _check(results, survivors, out, err, reference=fault_free)


def test_without_ulfm_a_failure_ends_the_job_and_says_which_mode(tmp_path):
    proc, out = _launch(tmp_path, 2, "rank=1,step=3,kind=kill", ft=False)
    stdout, err = _finish(proc)
    assert proc.returncode != 0
    assert "fault tolerance: none (launched without --with-ft ulfm)" in stdout
    assert _results(out) == {}


@pytest.mark.parametrize("failing,code", [("0,1", 1), ("1", 0)], ids=["all", "one"])
def test_matexrun_exits_1_when_every_rank_failed(tmp_path, failing, code):
    # Under ULFM mpiexec exits 0 even when every rank died: matexrun counts
    # the ranks' failure reports.
    script = tmp_path / "fail.py"
    script.write_text("import sys\nimport matex\n"
                      "if matex.rank() in map(int, sys.argv[1].split(',')):\n"
                      "    raise ValueError('boom on rank %d' % matex.rank())\n")
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    segments = set(glob.glob(SHM_SEGMENTS))
    proc = subprocess.Popen([matexrun, "--ft", "-n", "2", str(script), failing],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stdout, err = _finish(proc, timeout=120)
    assert proc.returncode == code, _tail(err)
    assert err.count("ValueError: boom on rank") == failing.count(",") + 1
    assert ("matexrun: every rank failed (2 of 2)" in err) == (code == 1)
    # No shared-memory segment left behind (ranks skip MPI_Finalize under ULFM,
    # and matexrun itself must not become an MPI process)
    assert _segments_left_behind(segments) == set()


def test_long_computation_is_not_mistaken_for_a_hang(tmp_path):
    # Computing longer than the detector's timeout, outside MPI and holding
    # Python's GIL: MaTEx's progress thread keeps the heartbeats flowing.
    script = tmp_path / "compute.py"
    # Rank 0 waits inside MPI, watching (ring detector) rank 2, which computes
    # for 1.6 timeouts: without heartbeats from rank 2 it would be declared dead.
    script.write_text(
        "import sys\nimport time\nimport matex\n"
        "comm = matex.comm()\n"
        "t = time.time()\n"
        "while matex.rank() > 0 and time.time() - t < 1.6 * float(sys.argv[1]):\n"
        "    pass\n"
        "total = comm.allreduce(1)\n"
        "print('ranks', total, matex.size(), flush=True)\n")
    ft = launch.ft_mpi_args()
    timeout = ft[ft.index("mpi_ft_detector_timeout") + 1]
    cmd = launch.mpiexec_command(3, [sys.executable, "-m", "matex", "--all-ranks", str(script),
                                     timeout], mpi_args=ft)
    env = launch.launch_env()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stdout, err = _finish(proc, timeout=120)
    assert proc.returncode == 0, _tail(err)
    assert stdout.count("ranks 3 3") == 3, (stdout, _tail(err))


class _Group:
    def __init__(self, size):
        self.size, self.freed = size, False

    def Get_size(self):
        return self.size

    def Free(self):
        self.freed = True


class _Comm:
    """What ``_resilience.failure_known`` asks of a communicator (ULFM's local queries)."""

    def __init__(self, revoked=False, failed=0):
        self.revoked, self.failed = revoked, _Group(failed)

    def Is_revoked(self):
        return self.revoked

    def Get_failed(self):
        return self.failed


@pytest.mark.parametrize("comm,expected", [
    (_Comm(revoked=True), True), (_Comm(failed=1), True), (_Comm(), False)],
    ids=["revoked", "a-rank-failed", "no-failure"])
def test_an_mpi_error_of_another_class_is_a_rank_failure_when_one_is_known(monkeypatch, comm,
                                                                           expected):
    # Open MPI 5.0's nonblocking allreduce (libnbc: MaTEx's agreement check before every
    # collective) reports MPI_ERR_OTHER, not MPI_ERR_REVOKED/PROC_FAILED, when it finds
    # the failure while starting a later round of its schedule: on rank 0, the binomial
    # root, when a survivor revoked (or a peer died) between two of its rounds. Rank 0
    # then died on "matex fused allreduce: MPI_Wait (agreement check) failed:
    # MPI_ERR_OTHER" instead of recovering (kill-at-begin, kill-in-evaluate). Under
    # ULFM such an error counts as a lost rank when a communicator MaTEx uses is revoked
    # or has a rank known failed; otherwise it stays an error.
    import tensorflow as tf
    from mpi4py import MPI

    from matex import _resilience, _runtime

    monkeypatch.setattr(_resilience, "mode", lambda: "ulfm")
    monkeypatch.setattr(_runtime._now, "comm", comm)
    monkeypatch.setattr(_runtime._now, "control", None)
    monkeypatch.setattr(_runtime, "_slots", {})
    op_error = tf.errors.InternalError(
        None, None, "matex fused allreduce: MPI_Wait (agreement check) failed: MPI_ERR_OTHER",
        {"matex.mpi_error_class": str(MPI.ERR_OTHER).encode()})
    assert _resilience.is_failure(op_error) is expected
    assert _resilience.is_failure(MPI.Exception(MPI.ERR_OTHER)) is expected
    # a torn pickled payload (a survivor once got "UnpicklingError" from allgather instead
    # of an MPI error): a lost rank when a failure is known, like an MPI error
    import pickle

    assert _resilience.is_failure(pickle.UnpicklingError("invalid load key")) is expected
    assert _resilience.is_failure(EOFError("Ran out of input")) is expected
    assert comm.failed.freed or comm.revoked
    # a mismatch or a plain error is never a lost rank; without ULFM nothing but the
    # failure classes is
    assert not _resilience.is_failure(ValueError("boom"))
    monkeypatch.setattr(_resilience, "mode", lambda: "none")
    assert not _resilience.is_failure(op_error)


def test_the_recovery_loop_gives_up_after_recoveries_that_lose_no_rank(monkeypatch):
    """A failure the shrink cannot remove (no rank lost, the same error again) ends the
    loop with RankFailure after FRUITLESS_RECOVERIES of them in a row; a recovery that
    did lose a rank starts the count again. Before, the loop retried without end."""
    from matex import _recovery, _resilience
    from matex.errors import RankFailure

    losses = iter([(4, 4), (4, 4), (4, 3)] + [(3, 3)] * 10)   # (old size, new size)
    calls = []

    def recover():
        old, new = next(losses)
        return _resilience.RankLoss([] if new == old else [3], old, new, 0.0, 0.0)

    def body():
        calls.append(1)
        raise RuntimeError("the same failure")

    monkeypatch.setattr(_resilience, "mode", lambda: "ulfm")
    monkeypatch.setattr(_resilience, "is_failure", lambda exc: True)
    monkeypatch.setattr(_resilience, "recover", recover)
    monkeypatch.setattr(_resilience, "check_replicas", lambda arrays: None)
    monkeypatch.setattr(_resilience, "notify", lambda info, callbacks: None)
    with pytest.raises(RankFailure, match="recoveries in a row lost no rank.*the same failure"):
        _recovery.run(body, [])
    # 2 fruitless, 1 that lost a rank, then FRUITLESS_RECOVERIES + 1 fruitless: raised
    assert len(calls) == 3 + _recovery.FRUITLESS_RECOVERIES + 1


# mid-training; and while the script's tf.function is first traced (a failure
# inside that first trace left TensorFlow refusing to create the step's variables
# in any later trace: every survivor died)
@pytest.mark.parametrize("fault", ["rank=1,step=13,kind=kill", "rank=1,step=0,kind=kill,at=build"],
                         ids=["mid-training", "in-the-first-trace"])
def test_custom_loop_under_run_resilient(tmp_path, fault):
    out = str(tmp_path / "c")
    env = launch.launch_env()
    env["MATEX_INJECT_FAULT"] = fault
    cmd = launch.mpiexec_command(3, [sys.executable, "-m", "matex", str(
        mpitools.ROOT / "tests" / "scripts" / "ft_custom_loop.py"), out, str(N), "32",
        str(EPOCHS)], mpi_args=["-x", "MATEX_INJECT_FAULT"] + launch.ft_mpi_args())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stdout, err = _finish(proc)
    assert proc.returncode == 0, _tail(err)
    results = _results(out)
    assert sorted(results) == [0, 2]
    assert len({r["digest"] for r in results.values()}) == 1
    for r in results.values():
        assert r["size"] == 2 and r["recoveries"] == 1 and r["iterations"] == STEPS * EPOCHS
        assert r["seen"] == [float(EPOCHS)] * N


def test_without_ulfm_restart_resumes_from_an_intact_checkpoint(tmp_path):
    # Rank 0 is killed while writing the epoch-2 checkpoint (data written, not
    # yet renamed): the job dies, matexrun restarts it on one rank fewer, and
    # training resumes from the intact epoch-1 checkpoint.
    out = str(tmp_path / "r")
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    proc = subprocess.Popen(
        [matexrun, "--restart", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--inject-fault", "rank=0,step=20,kind=kill,at=checkpoint", "-n", "3",
         SCRIPT, out, str(N), "32", str(EPOCHS)],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, err = _finish(proc, timeout=300)
    assert proc.returncode == 0, _tail(err)
    assert "fault tolerance: checkpoint/restart" in stdout
    assert "restarting from the last checkpoint" in err and "on 2 rank(s)" in err
    assert "resumed from the checkpoint" in stdout and "at epoch 2" in stdout
    results = _results(out)
    assert sorted(results) == [0, 1] and len({r["digest"] for r in results.values()}) == 1
    for r in results.values():
        assert r["size"] == 2
        assert r["seen"] == [float(EPOCHS)] * N   # epoch 1 from the checkpoint, 2 and 3 anew


# A rank lost right before one of the collectives added for Horovod's API (#25), or
# the commit vote (matex.should_commit, MPI's agreement under ULFM): the survivors meet
# the failure inside it, recover under run_resilient, and every later
# result of every such collective equals NumPy's for the ranks alive then.
@pytest.mark.parametrize("kills,survivors", [
    ("1:3:alltoall,4:8:reducescatter,0:14:adasum,3:18:should_commit", [2]),
    ("4:3:grouped_allgather,0:8:broadcast_object,2:14:allgather_object,3:20:barrier", [1]),
], ids=["alltoall-reducescatter-adasum-vote", "grouped-allgather-objects-barrier"])
def test_a_rank_lost_inside_each_new_collective(tmp_path, kills, survivors):
    out = str(tmp_path / "c")
    env = dict(launch.launch_env(), FT_KILL_BEFORE=kills)
    cmd = launch.mpiexec_command(5, [sys.executable, "-m", "matex", str(
        mpitools.ROOT / "tests" / "scripts" / "ft_custom_loop.py"), out, str(N), "32",
        str(EPOCHS), "collectives"], mpi_args=["-x", "FT_KILL_BEFORE"] + launch.ft_mpi_args())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stdout, err = _finish(proc)
    assert proc.returncode == 0, _tail(err)
    results = _results(out)
    assert sorted(results) == survivors, _tail(err)
    assert len({r["digest"] for r in results.values()}) == 1
    for r in results.values():
        assert r["mismatches"] == []
        assert r["size"] == len(survivors) and r["recoveries"] == kills.count(":") // 2
        assert r["iterations"] == STEPS * EPOCHS and r["seen"] == [float(EPOCHS)] * N


# Horovod process sets across a shrink (#25 item 3): world rank 1 (in set A = [0, 1, 2]
# only) dies at step 2; A's other members meet the failure inside A's allreduce, B = [2, 3]'s
# rank 3 waits on rank 2, which went on to recover (the sets' communicators are revoked
# with MaTEx's). Every later step's set sums, object gathers, ranks and the function
# traced before the failure match NumPy over the survivors, renumbered as Horovod would.
def test_process_sets_keep_working_over_their_survivors(tmp_path):
    out = str(tmp_path / "p")
    env = dict(launch.launch_env(), FT_KILL="1:2", TF_CPP_MIN_LOG_LEVEL="2")
    cmd = launch.mpiexec_command(4, [sys.executable, "-m", "matex", str(
        mpitools.ROOT / "tests" / "scripts" / "ft_process_sets.py"), out, "6"],
        mpi_args=["-x", "FT_KILL"] + launch.ft_mpi_args())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=str(tmp_path))
    stdout, err = _finish(proc)
    assert proc.returncode == 0, _tail(err)
    results = _results(out)
    assert sorted(results) == [0, 2, 3], _tail(err)
    for r in results.values():
        assert r["mismatches"] == [] and r["size"] == 3 and r["recoveries"] == 1
        assert r["ranks"] == {"A": [0, 1], "B": [1, 2]} and r["iterations"] == 6
        assert r["w"] == [pytest.approx(-0.1 * (2 * 4 + 4 * 3))]   # SGD 0.1 on summed ones
    assert results[0]["traces"] == results[2]["traces"] == 1   # no retrace after the shrink
