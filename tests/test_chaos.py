"""The chaos tier: kill -9 one or two random ranks at a uniformly random moment.

``pytest -m chaos``. Each run launches a workload on 4 ranks under ``mpiexec
--with-ft ulfm`` and SIGKILLs one or two random ranks from outside at a moment
drawn uniformly over the workload's run (from the moment all four ranks exist
to the end of a fault-free run of the same workload, timed in this session),
so kills fall in start-up, fit's set-up, the first step's trace, training,
validation and evaluate alike. Every run must end as promised: exit 0, every
rank that was not killed finishes, replica digests equal, and every sample
trained exactly once per epoch (counted inside the model, rolled back with it).

Workloads: ``fit`` (fit with validation, then evaluate: tests/scripts/ft_fit.py),
``loop`` (a custom loop under ``run_resilient``: ft_custom_loop.py),
``localsgd`` (LocalSGD in fit: ft_localsgd.py).

Switches: ``MATEX_CHAOS_RUNS`` (default 2, as ``make test`` runs it; a campaign
sets 100), ``MATEX_CHAOS_WORKLOADS`` (comma-separated, default all three, taken
in turn), ``MATEX_CHAOS_SEED`` (the plan of workloads, victims and moments;
default 1, so ``make test`` draws the same plan every time, while the moments
still fall on whatever the run is doing then; ``random`` draws one, printed
so a failing run can be replayed). The campaign's survival rate is in the
README.
"""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

import mpitools
from matex import launcher as launch

TIER = "chaos"
NRANKS = 4
SCRIPTS = mpitools.ROOT / "tests" / "scripts"
# name: (script and arguments after OUT, samples, epochs, optimizer steps at the end)
WORKLOADS = {
    "fit": (["ft_fit.py", "{out}", "300", "32", "3", "validate"], 300, 3, 30),
    "loop": (["ft_custom_loop.py", "{out}", "300", "32", "3"], 300, 3, 30),
    "localsgd": (["ft_localsgd.py", "{out}", "localsgd"], 300, 2, 20),
}
RUNS = int(os.environ.get("MATEX_CHAOS_RUNS", "2"))
CHOSEN = [w.strip() for w in os.environ.get("MATEX_CHAOS_WORKLOADS",
                                            ",".join(WORKLOADS)).split(",") if w.strip()]
_SEED = os.environ.get("MATEX_CHAOS_SEED", "1")   # make test: a fixed plan; "random": drawn
SEED = random.SystemRandom().randrange(1 << 30) if _SEED == "random" else int(_SEED)
TIMEOUT = 400
_durations = {}   # workload -> seconds of a fault-free run, from all ranks up to the end


def _launch(workload, out):
    args, _, _, _ = WORKLOADS[workload]
    program = [sys.executable, "-m", "matex", str(SCRIPTS / args[0])] + [
        a.format(out=out) for a in args[1:]]
    env = launch.launch_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    cmd = launch.mpiexec_command(NRANKS, program, mpi_args=launch.ft_mpi_args())
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _ranks(proc, script):
    """{world rank: psutil.Process} of the job's ranks running ``script`` (so far)."""
    found = {}
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            if not any(script in part for part in child.cmdline()):
                continue
            rank = child.environ().get("OMPI_COMM_WORLD_RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None:
            found[int(rank)] = child
    return found


def _wait_for_ranks(proc, script, deadline):
    while time.time() < deadline and proc.poll() is None:
        ranks = _ranks(proc, script)
        if len(ranks) == NRANKS:
            return ranks
        time.sleep(0.05)
    return _ranks(proc, script)


def _finish(proc, deadline):
    try:
        return proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError("hung: killed after %d s\n%s\n%s" % (TIMEOUT, out[-2000:],
                                                                 err[-6000:]))


def _results(out):
    return {int(p.rsplit(".", 1)[1]): json.load(open(p)) for p in glob.glob(out + ".[0-9]*")}


def _fault_free_seconds(workload, tmp_path_factory):
    """How long a fault-free run of ``workload`` takes once its ranks exist (cached)."""
    if workload not in _durations:
        out = str(tmp_path_factory.mktemp("chaos-free-" + workload) / "r")
        proc = _launch(workload, out)
        deadline = time.time() + TIMEOUT
        script = WORKLOADS[workload][0][0]
        ranks = _wait_for_ranks(proc, script, deadline)
        started = time.time()
        stdout, err = _finish(proc, deadline)
        assert proc.returncode == 0 and len(ranks) == NRANKS, err[-4000:]
        assert sorted(_results(out)) == list(range(NRANKS)), err[-4000:]
        _durations[workload] = time.time() - started
    return _durations[workload]


def _runs():
    rng = random.Random(SEED)
    plan = []
    for i in range(RUNS):
        workload = CHOSEN[i % len(CHOSEN)]
        victims = sorted(rng.sample(range(NRANKS), rng.choice([1, 2])))
        plan.append((i, workload, victims, rng.random()))
    return plan


@pytest.mark.parametrize("run,workload,victims,moment", _runs(),
                         ids=["%d-%s-kill%s" % (i, w, "+".join(map(str, v)))
                              for i, w, v, _ in _runs()])
def test_random_kill(tmp_path, tmp_path_factory, run, workload, victims, moment):
    print("chaos: MATEX_CHAOS_SEED=%d run %d: %s, kill %s at %.0f%% of the run"
          % (SEED, run, workload, victims, 100 * moment))
    if workload not in WORKLOADS:
        raise AssertionError("unknown workload %r (MATEX_CHAOS_WORKLOADS): %s"
                             % (workload, ", ".join(WORKLOADS)))
    duration = _fault_free_seconds(workload, tmp_path_factory)
    _, samples, epochs, iterations = WORKLOADS[workload]
    script = WORKLOADS[workload][0][0]
    out = str(tmp_path / "r")
    proc = _launch(workload, out)
    deadline = time.time() + TIMEOUT
    ranks = _wait_for_ranks(proc, script, deadline)
    if len(ranks) < NRANKS:
        stdout, err = _finish(proc, deadline)
        raise AssertionError("the ranks never all started (exit %s)\n%s"
                             % (proc.returncode, err[-4000:]))
    time.sleep(moment * duration)
    killed = []
    for v in victims:
        try:
            ranks[v].send_signal(signal.SIGKILL)
            killed.append(v)
        except psutil.NoSuchProcess:
            pass   # it had already finished
    stdout, err = _finish(proc, deadline)
    context = "MATEX_CHAOS_SEED=%d run %d (%s, kill %s at %.1f of %.1f s)\n%s" % (
        SEED, run, workload, victims, moment * duration, duration, err[-6000:])
    assert proc.returncode == 0, context
    results = _results(out)
    others = [r for r in range(NRANKS) if r not in victims]
    assert set(others) <= set(results), ("a rank that was not killed did not finish",
                                         sorted(results), context)
    assert len({r["digest"] for r in results.values()}) == 1, ("replicas differ", context)
    sizes = {r["size"] for r in results.values()}
    assert len(sizes) == 1 and len(others) <= sizes.pop() <= NRANKS, (sizes, context)
    for rank, r in results.items():
        assert r["iterations"] == iterations, (rank, r["iterations"], context)
        assert r["seen"] == [float(epochs)] * samples, (
            "rank %d: a sample was lost or trained twice" % rank, context)
