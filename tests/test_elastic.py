"""Horovod's elastic API on MaTEx (#25 item 6): ``hvd.elastic.run`` and its states.

* A rank killed inside a step under ``matexrun --ft --horovod``
  (tests/scripts/elastic_loop.py, written for Horovod): the survivors restore
  to the last commit, synchronise, and run ``train`` again; every committed
  step counted once, every sample trained on once per epoch, replicas equal.
  Then ``fit`` with ``KerasState`` and the elastic callbacks loses a rank in
  its third epoch and ends with exactly its steps.
* Ranks killed inside ``backward_passes_per_step`` accumulation
  (tests/scripts/elastic_accumulate.py): each gradient summed exactly once.
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

from test_cluster import nscluster, two_hosts  # noqa: F401 - the namespace hosts fixture

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
    """3 ranks: rank 1 killed inside step 5 of the custom loop (before its gradient
    allreduce); then, in the fit phase, rank 2 killed inside step 9 (epoch 3)."""
    out = tmp_path / "r"
    proc = subprocess.run([MATEXRUN, "--ft", "--horovod", "-n", "3", "--inject-fault",
                           "rank=1,step=5,kind=kill; rank=2,step=9,kind=kill",
                           str(SCRIPTS / "elastic_loop.py"), str(out), str(PER_EPOCH),
                           str(EPOCHS), "fit"],
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
    # fit with KerasState and the elastic callbacks, committing at epoch ends: rank 0
    # restored the commit of epoch 2 and fit the last epoch alone (4 steps, not 5+)
    fit = _reports(str(out) + ".fit")
    assert sorted(fit) == [0], err
    assert fit[0]["launches"] == [[0, 2], [2, 1]], fit[0]
    assert (fit[0]["epoch"], fit[0]["batch"], fit[0]["iterations"]) == (3, 0, 3 * 4), fit[0]


def test_a_rank_lost_before_the_first_collective_of_run_is_recovered(tmp_path):
    """3 ranks: rank 2 killed on entering hvd.elastic.run, before its first collective
    (reading the commit on disk, the first sync). That collective ran outside the
    recovery loop, so the loss ended every survivor; now the two survivors train every
    step, each sample once per epoch, with equal states."""
    out = tmp_path / "r"
    proc = subprocess.run([MATEXRUN, "--ft", "--horovod", "-n", "3", "--inject-fault",
                           "rank=2,step=0,kind=kill,at=elastic",
                           str(SCRIPTS / "elastic_loop.py"), str(out), str(PER_EPOCH),
                           str(EPOCHS)],
                          capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=tmp_path)
    err = proc.stderr[-4000:]
    assert proc.returncode == 0, err
    done = _reports(out)
    assert sorted(done) == [0, 1], err
    steps = PER_EPOCH * EPOCHS
    assert len({rep["digest"] for rep in done.values()}) == 1, "survivors' states differ"
    for rep in done.values():
        assert rep["returned"] == rep["batch"] == rep["iterations"] == steps, rep
        assert rep["seen"] == [float(EPOCHS)] * (PER_EPOCH * 12), "a sample lost or repeated"
        assert rep["sizes"] == [2] * steps, rep["sizes"]


@pytest.mark.parametrize("flavour", ["keras3", "keras2"])
def test_ranks_lost_inside_accumulation_count_each_gradient_once(tmp_path, flavour):
    """3 ranks, ``backward_passes_per_step=2``, a commit after every call: rank 1 killed
    in call 5 (a reducing call: the survivors' reduction fails after each had added the
    call's gradient and counted it), rank 2 in call 8 (a counting call, no collective:
    the survivors learn of it in call 9). The accumulation counter and accumulators are
    restored with the commit, so every call's gradient (exactly 1) is summed once:
    ``w == -12`` after 12 calls. Before, the survivors kept the interrupted reducing call's
    writes to them (counter and sums), and its redo counted instead of reducing: one
    update lost, ``w == -10``. Keras 2 (tf-keras) optimizers' accumulation joins the same
    recovery state (before, it did not: ``w == -10``)."""
    out = tmp_path / "r"
    proc = subprocess.run([MATEXRUN, "--ft", "--horovod", "-n", "3", "--inject-fault",
                           "rank=1,step=5,kind=kill; rank=2,step=8,kind=kill",
                           str(SCRIPTS / "elastic_accumulate.py"), str(out), "12"]
                          + (["keras2"] if flavour == "keras2" else []),
                          capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=tmp_path)
    err = proc.stderr[-4000:]
    assert proc.returncode == 0, err
    done = _reports(out)
    assert sorted(done) == [0], err
    assert done[0] == {"w": -12.0, "batch": 12, "iterations": 12, "counter": 0, "size": 1}, \
        (done[0], err)


@pytest.mark.parametrize("flavour", ["keras3", "keras2"])
def test_a_restart_resumes_accumulation_from_the_commit_on_disk(tmp_path, flavour):
    """Commits written to disk (``MATEX_CHECKPOINT_DIR``, as ``matexrun --elastic`` sets
    it) hold ``backward_passes_per_step``'s counter and the ranks' accumulators: 3 ranks,
    rank 1 killed in call 5 without ``--ft`` (the job ends), the commit on disk was made
    after call 4 (counter 1, each rank's accumulator 1); a second launch resumes there
    and ends with every call's gradient summed once, ``w == -12``. Before, the restart
    began from a zero counter and zero accumulators: call 4's gradient was lost, the
    pairs shifted by one call and the last call's gradient was left unapplied
    (``w == -10``, counter 1)."""
    out, ckpt = tmp_path / "r", tmp_path / "ckpt"
    argv = [str(SCRIPTS / "elastic_accumulate.py"), str(out), "12"] + (
        ["keras2"] if flavour == "keras2" else [])
    env = _env({"MATEX_CHECKPOINT_DIR": str(ckpt)})
    first = subprocess.run([MATEXRUN, "--horovod", "-n", "3", "--inject-fault",
                            "rank=1,step=5,kind=kill"] + argv,
                           capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert first.returncode != 0 and _reports(out) == {}, first.stderr[-3000:]
    assert [p.suffix for p in ckpt.iterdir()] == [".pkl"], first.stderr[-3000:]
    second = subprocess.run([MATEXRUN, "--horovod", "-n", "3"] + argv, capture_output=True,
                            text=True, timeout=300, env=env, cwd=tmp_path)
    err = second.stderr[-4000:]
    assert second.returncode == 0, err
    assert "resumed from commit 5" in second.stdout, second.stdout[-2000:]
    done = _reports(out)
    assert sorted(done) == [0, 1, 2], err
    for rep in done.values():
        assert rep == {"w": -12.0, "batch": 12, "iterations": 12, "counter": 0, "size": 3}, \
            (rep, err)
    assert list(ckpt.iterdir()) == []   # the finished function's commit is removed


# ------------------------------------------------- a host lost with its Open MPI daemon

HOST_STEPS = 40


def _elastic_argv(discover, ckpt, out):
    return [MATEXRUN, "-v", "--ft", "--elastic", "--ft-heartbeat", "1",
            "--host-discovery-script", str(discover), "--checkpoint-dir", str(ckpt),
            "--launch-agent", str(nscluster.AGENT_SH), "--tcp-if", "eth0",
            "--mpi-arg=--mca", "--mpi-arg=btl", "--mpi-arg=tcp,self",
            str(SCRIPTS / "elastic_hosts.py"), str(out), str(HOST_STEPS)]


def test_a_lost_host_restarts_the_job_on_the_other_from_the_last_commit(two_hosts,  # noqa: F811
                                                                        tmp_path):
    """One rank on each of two namespace hosts; host 1's prted and rank are SIGKILLed at
    step 8 or later. ULFM cannot go on (PRTE ends the job); matexrun asks the discovery
    script, which lists host 0 only by then, and restarts there from the commit on disk."""
    h0, h1 = two_hosts.hosts
    listed = tmp_path / "hosts"
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\ncat %s\n" % listed)
    discover.chmod(0o755)
    ckpt, out = tmp_path / "ckpt", tmp_path / "r"
    progress = Path(str(out) + ".progress")
    for attempt in (1, 2):
        listed.write_text("%s:1\n%s:1\n" % (h0, h1))
        progress.unlink(missing_ok=True)
        proc = two_hosts.start(_elastic_argv(discover, ckpt, out))
        deadline, at = time.time() + 90, 0
        while at < 8 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
            try:
                at = json.loads(progress.read_text())["step"]
            except (OSError, ValueError):
                pass
        if at < 8:
            stdout, stderr = two_hosts.abort(proc)
            diag = "reached step %d of 8\n%s\n%s\n%s" % (at, stdout[-2000:], stderr[-4000:],
                                                         two_hosts.diagnostics())
            if attempt == 1:
                print("launch failed, retrying once:\n" + diag, file=sys.stderr)
                continue
            raise AssertionError(diag)
        listed.write_text("%s:1\n" % h0)   # host 1 is gone from now on
        victims = two_hosts.processes(h1)
        assert any("prted" in cmd for _, cmd in victims), victims
        for pid, _ in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass   # gone already
        proc = two_hosts.finish(proc, 120)
        break
    diag = "exit %d\n%s\n%s" % (proc.returncode, proc.stdout[-2000:], proc.stderr[-5000:])
    assert proc.returncode == 0, diag
    # the first launch died whole (PRTE ends it: ULFM cannot go on without the daemon)
    assert "every rank failed (2 of 2)" in proc.stderr, diag
    assert "hosts available now: %s:1" % h0 in proc.stderr, diag
    assert "restarting from the last checkpoint in %s on 1 rank(s)" % ckpt in proc.stderr, diag
    done = _reports(out)
    assert sorted(done) == [0], diag
    rep = done[0]
    assert rep["hostname"] == h0 and rep["size"] == 1 and rep["returned"] == HOST_STEPS, rep
    log, resumed = rep["log"], rep["started"]
    # every step committed exactly once, in order, across the two launches
    assert [entry[0] for entry in log] == list(range(HOST_STEPS)), log
    # the restart began from the last commit, which is no earlier than the step seen at
    # the kill: nothing committed was lost
    assert at <= resumed < HOST_STEPS, (at, resumed)
    assert all(entry[1:] == [2, 1] for entry in log[:resumed]), log     # both hosts
    assert all(entry[1:] == [1, 0] for entry in log[resumed:]), log     # host 0 alone
    assert not list(ckpt.glob("elastic-*")), "the commit file outlived the finished run"


# ------------------------------------------------- matexrun --elastic's plan (no launch)


def _dry(args, tmp_path, listing="a:2\nb\n# a comment\n\nc:3\n"):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\nprintf '%s'\n" % listing.replace("\n", "\\n"))
    discover.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    argv = [a.replace("DISCOVER", str(discover)) for a in args]
    return subprocess.run([MATEXRUN, "--dry-run"] + argv + [str(script)], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=tmp_path)


def test_elastic_plan_takes_the_hosts_from_the_discovery_script(tmp_path):
    proc = _dry(["--host-discovery-script", "DISCOVER"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stderr.strip().splitlines()[-1]
    # horovodrun's flag alone means --elastic, which means --ft; a host without slots: 1
    assert " -n 6 --host a:2,b:1,c:3 " in cmd and "--with-ft ulfm" in cmd, cmd
    assert "-x MATEX_CHECKPOINT_DIR" in cmd, cmd
    # horovodrun's spellings; a flag with no meaning here is named once
    proc = _dry(["--host-discovery-script", "DISCOVER", "--slots-per-host", "4",
                 "--max-num-proc", "5", "--blacklist-cooldown-range", "60", "300"], tmp_path)
    assert " -n 5 --host a:2,b:4,c:3 " in proc.stderr, proc.stderr
    assert proc.stderr.count("horovodrun's --blacklist-cooldown-range has no meaning") == 1


def test_elastic_options_are_checked_before_launching(tmp_path):
    for args, message in [
        (["--min-np", "2"], "--min-np goes with --elastic or --host-discovery-script"),
        (["--elastic", "--restart", "2"], "do not combine it with --restart"),
        (["--elastic", "--min-np", "3", "--max-np", "2"], "--min-np 3 is above --max-np 2"),
        (["--host-discovery-script", "DISCOVER", "-H", "x:1"], "not both"),
        (["--host-discovery-script", "DISCOVER", "--min-np", "7"],
         "--min-np 7 is above the 6 rank(s) of the first launch"),
    ]:
        proc = _dry(args, tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    proc = _dry(["--host-discovery-script", "DISCOVER"], tmp_path, listing="\n")
    assert proc.returncode == 2 and "lists no host" in proc.stderr, proc.stderr
    proc = _dry(["--host-discovery-script", "DISCOVER"], tmp_path, listing="a:x\n")
    assert proc.returncode == 2 and "bad host 'a:x'" in proc.stderr, proc.stderr


def test_restarts_follow_the_plan_until_it_says_stop():
    from matex.launcher import supervise

    launches, plans = [], iter([(["mpiexec", "-n", "3", "x"], 3), None])

    def run(cmd, env, nranks):
        launches.append((cmd, nranks, env["MATEX_INJECT_FAULT"]))
        return 1

    env = {"MATEX_CHECKPOINT_DIR": "/ckpt", "MATEX_INJECT_FAULT": "rank=1,step=2,kind=kill"}
    code = supervise.run_with_restarts(["mpiexec", "-n", "4", "x"], 4, env, 5, run=run,
                                       replan=lambda cmd, n: next(plans))
    assert code == 1
    assert launches == [(["mpiexec", "-n", "4", "x"], 4, "rank=1,step=2,kind=kill"),
                        (["mpiexec", "-n", "3", "x"], 3, "")]   # faults fire once
    # --restart's default plan: one rank fewer each time, down to one
    launches.clear()
    code = supervise.run_with_restarts(["mpiexec", "-n", "2", "x"], 2, dict(env), 5, run=run)
    assert [n for _, n, _ in launches] == [2, 1]


def test_a_restart_waits_for_min_np_slots_then_gives_up(tmp_path, capsys):
    """Before a restart, matexrun asks the discovery script again while it lists fewer
    than --min-np slots, for up to --elastic-timeout seconds (horovodrun's rule)."""
    import argparse

    from matex.launcher import cli, find_mpiexec

    calls = tmp_path / "calls"
    discover = tmp_path / "discover.sh"
    # one host on the first call, two from the second on
    discover.write_text("#!/bin/sh\necho x >> %s\necho a:1\n"
                        "[ $(wc -l < %s) -ge 2 ] && echo b:1\nexit 0\n" % (calls, calls))
    discover.chmod(0o755)
    opts = argparse.Namespace(host_discovery_script=str(discover), slots=None, max_np=None,
                              min_np=2, elastic_timeout=30.0, launch_agent=None, tcp_if=None)
    replan = cli._elastic_replan(opts, find_mpiexec(), {}, ["python", "t.py"], ["--x"], 3)
    cmd, n = replan(["old"], 3)
    assert n == 2 and cmd[1:5] == ["-n", "2", "--host", "a:1,b:1"], cmd
    assert cmd[-3:] == ["--x", "python", "t.py"], cmd
    assert calls.read_text().count("x") == 2
    err = capsys.readouterr().err
    assert "lists 1 slot(s), fewer than --min-np 2; waiting up to 30 s" in err, err
    calls.write_text("")
    opts.min_np, opts.elastic_timeout = 3, 0.5   # never enough: gives up
    replan = cli._elastic_replan(opts, find_mpiexec(), {}, ["python", "t.py"], [], 3)
    assert replan(["old"], 3) is None
    assert "fewer than --min-np 3 after 0 s (--elastic-timeout); not restarting" in (
        capsys.readouterr().err)
