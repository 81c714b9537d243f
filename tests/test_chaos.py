"""The chaos tier: kill -9 one or two random ranks at a uniformly random moment.

``pytest -m chaos``. Each run launches a workload on 4 ranks with ``matexrun
--ft`` (as users launch: ULFM, and the launcher's relaunch when a rank dies
while MPI starts, which ULFM cannot survive) and SIGKILLs one or two random
ranks from outside at a moment drawn uniformly over the workload's run (from
the moment all four ranks exist to the end of a fault-free run of the same
workload, timed in this session), so kills fall in start-up, fit's set-up,
the first step's trace, training, validation and evaluate alike. Every run
must end as promised; for the training workloads: exit 0, every rank that was
not killed finishes, replica digests equal, and every sample trained exactly
once per epoch (counted inside the model, rolled back with it).

Workloads: ``fit`` (fit with validation, then evaluate: tests/scripts/ft_fit.py),
``loop`` (a custom loop under ``run_resilient``: ft_custom_loop.py),
``localsgd`` (LocalSGD in fit: ft_localsgd.py), and, each checked against what
MaTEx promises for it (one check function per workload):

* ``predict`` (tests/scripts/chaos_predict.py): ``evaluate`` then ``predict``,
  three rounds over 4,096 rows, with integer weights and inputs, so every number
  is exact whatever the division of rows: every survivor's predictions equal
  the fault-free run's row for row (each row once, in order), its ``mae`` and
  ``mse`` equal them exactly, its loss to 1e-6 (Keras's loss is a mean of
  per-batch means, which rounds with the batches' cut), its weights' digest too;
* ``search`` (chaos_search.py): ``matex.hpo.minimize``, 8 trials of a Branin
  function that waits 0.3 s and sums over its group of 2 ranks: exit 0, the
  survivors finish and agree on the best point and value, and the tuner
  directory holds each of the 8 trials exactly once (the oracle's end order),
  all completed (a trial whose group lost a rank runs again, it is not failed),
  each with Branin's exact value, the best the least of them;
* ``pipeline`` (chaos_pipeline.py): a 4-stage ``PipelineModel``'s ``fit`` and
  ``predict``. A pipeline does not recover: every survivor either ends with
  ``matex.errors.RankFailure`` naming exactly the killed ranks, or (the kill
  came after its run was done) holds the complete result, equal to the
  fault-free run's; nothing hangs. ``mpiexec``'s exit status is not checked
  (under ULFM it is 0 whatever the ranks did);
* ``elastic`` (elastic_loop.py, a script written for Horovod, under ``matexrun
  --ft --horovod``): ``hvd.elastic.run`` over a custom loop committing every
  step (450), then Horovod's elastic Keras recipe (``fit`` with a ``KerasState``
  and the three elastic callbacks, committing at epoch ends): exit 0, every
  survivor finishes both, equal digests after each, every step committed once
  (``iterations`` equals the steps), every sample trained once per epoch, the
  number of ranks never growing. The check prints where the kill landed
  (start-up, the loop, fit, after).

A run whose kill fell while MPI started is relaunched by matexrun on the
ranks left (renumbered from 0); the checks then expect those.

What these runs found is kept as named deterministic tests at the end (2 ranks,
a rank that SIGKILLs itself at the spot): a pipeline stage lost in
``PipelineModel``'s construction or as ``fit`` starts, and a rank lost just
before ``minimize`` builds its groups, ended every survivor with a raw
``MPI_ERR_PROC_FAILED`` instead of ``RankFailure`` / a search that goes on
(fixed in 9529953); with 2 ranks per trial, the shrunk survivors then failed
"does not divide" (fixed in a67a100: groups made as launched, regrouped).
A kill while MPI started hung every survivor inside ``MPI_Init`` (under a
bare mpiexec; matexrun --ft relaunches, tests/test_launch.py).

Switches: ``MATEX_CHAOS_RUNS`` (default 2, as ``make test`` runs it; a campaign
sets 100), ``MATEX_CHAOS_WORKLOADS`` (comma-separated, default all, taken
in turn in the order above: fit, loop, localsgd, predict, search, pipeline, elastic;
``make test``'s 2 runs are fit and loop), ``MATEX_CHAOS_SEED`` (the plan of
workloads, victims and moments; default 1, so ``make test`` draws the same
plan every time, while the moments still fall on whatever the run is doing
then; ``random`` draws one, printed so a failing run can be replayed). The
campaign's survival rate is in the README.
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

import psutil
import pytest

import mpitools
from matex import launcher as launch

TIER = "chaos"
NRANKS = 4
SCRIPTS = mpitools.ROOT / "tests" / "scripts"
RUNS = int(os.environ.get("MATEX_CHAOS_RUNS", "2"))
_SEED = os.environ.get("MATEX_CHAOS_SEED", "1")   # make test: a fixed plan; "random": drawn
SEED = random.SystemRandom().randrange(1 << 30) if _SEED == "random" else int(_SEED)
TIMEOUT = 400
_free_runs = {}   # workload -> (seconds of a fault-free run from all ranks up to the end, results)


def _survivors(results, victims, context, nranks=NRANKS):
    others = [r for r in range(nranks) if r not in victims]
    assert set(others) <= set(results), ("a rank that was not killed did not finish",
                                         sorted(results), context)
    return others


def _sizes(results, others, context, nranks=NRANKS):
    sizes = {r["size"] for r in results.values()}
    assert len(sizes) == 1 and len(others) <= sizes.pop() <= nranks, (sizes, context)


def _check_training(samples, epochs, iterations):
    """fit / loop / localsgd: exit 0, survivors finish, equal digests, each sample once an epoch."""
    def check(proc, results, victims, killed, free, context):
        assert proc.returncode == 0, context
        others = _survivors(results, victims, context)
        assert len({r["digest"] for r in results.values()}) == 1, ("replicas differ", context)
        _sizes(results, others, context)
        for rank, r in results.items():
            assert r["iterations"] == iterations, (rank, r["iterations"], context)
            assert r["seen"] == [float(epochs)] * samples, (
                "rank %d: a sample was lost or trained twice" % rank, context)
    return check


def _check_predict(rows, rounds):
    """Every survivor's evaluate and predict equal the fault-free run's (exact numbers)."""
    def check(proc, results, victims, killed, free, context):
        assert proc.returncode == 0, context
        others = _survivors(results, victims, context)
        assert len({r["digest"] for r in results.values()}) == 1, ("replicas differ", context)
        _sizes(results, others, context)
        reference = (free or results)[0]["rounds"]
        assert len(reference) == rounds
        for got in reference:   # the fault-free run itself: every row once, in order
            assert [row[0] for row in got["predict"]] == [float(i) for i in range(rows)], context
        for rank, r in results.items():
            assert len(r["rounds"]) == rounds, (rank, context)
            for i, (got, want) in enumerate(zip(r["rounds"], reference)):
                assert got["predict"] == want["predict"], (
                    "rank %d round %d: predict differs from the fault-free run's" % (rank, i),
                    [row[0] for row in got["predict"]][:20], context)
                g, w = got["evaluate"], want["evaluate"]
                assert (g["mae"], g["mse"]) == (w["mae"], w["mse"]), (rank, i, g, w, context)
                assert abs(g["loss"] - w["loss"]) <= 1e-6 * abs(w["loss"]), (rank, i, g, w,
                                                                              context)
    return check


def _branin(x1, x2):
    import math

    a, b, c = 1.0, 5.1 / (4 * math.pi ** 2), 5 / math.pi
    return (a * (x2 - b * x1 ** 2 + c * x1 - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi))
            * math.cos(x1) + 10)


def _check_search(trials, nranks=NRANKS):
    """Survivors finish and agree; each trial recorded exactly once, completed, exact value."""
    def check(proc, results, victims, killed, free, context):
        assert proc.returncode == 0, context
        others = _survivors(results, victims, context, nranks)
        _sizes(results, others, context, nranks)
        answers = {json.dumps([r["best"], r["value"]], sort_keys=True) for r in results.values()}
        assert len(answers) == 1, ("the survivors disagree on the best trial", answers, context)
        directory = os.path.join(proc.matex_out + ".search", "minimize")
        state = json.load(open(os.path.join(directory, "oracle.json")))
        ids = [str(i) for i in range(trials)]
        assert sorted(state["end_order"], key=int) == ids, (state["end_order"], context)
        assert state["ongoing_trials"] == {} and state["retry_queue"] == [], (state, context)
        scores = {}
        for i in ids:
            t = json.load(open(os.path.join(directory, "trial_%s" % i, "trial.json")))
            hp = t["hyperparameters"]["values"]
            assert t["status"] == "COMPLETED", (i, t["status"], t["message"], context)
            assert t["score"] == _branin(hp["x1"], hp["x2"]), (i, t["score"], hp, context)
            scores[i] = (t["score"], hp)
        best = min(scores.values(), key=lambda s: s[0])
        r = next(iter(results.values()))
        assert (r["value"], r["best"]) == best, (r["value"], r["best"], best, context)
    return check


def _lost_named(message):
    import re

    match = re.search(r"rank\(s\) ([0-9, ]+) of this", message)
    return sorted(int(v) for v in match.group(1).split(",")) if match else None


def _check_pipeline(epochs, rows, nranks=NRANKS):
    """Each survivor: RankFailure naming exactly the killed ranks, or the complete result."""
    def check(proc, results, victims, killed, free, context):
        others = _survivors(results, victims, context, nranks)
        finished = [r for _, r in sorted(results.items()) if r["outcome"] == "finished"]
        # relaunched by matexrun on the ranks left (a kill while MPI started): another,
        # smaller pipeline (one stage per rank), whose ranks must agree with each other
        smaller = bool(finished) and finished[0]["size"] == len(others) < nranks
        if smaller or not free:
            reference = finished[0] if finished else None   # (None: no rank finished)
        else:
            reference = free[0]
        for rank, r in results.items():
            if r["outcome"] == "RankFailure":
                if rank not in others:
                    continue   # a victim that saw the other victim's loss before its own
                assert _lost_named(r["message"]) == sorted(killed), (
                    "rank %d names the wrong ranks" % rank, killed, r["message"], context)
                continue
            assert r["outcome"] == "finished", (rank, r, context)
            assert r["size"] == (len(others) if smaller else nranks), (rank, r, context)
            assert len(r["loss"]) == epochs, (rank, r, context)
            assert len(r["predict"]) == rows, (rank, len(r["predict"]), context)
            assert r["loss"] == reference["loss"], (rank, r["loss"], reference["loss"], context)
            assert r["predict"] == reference["predict"], ("rank %d: predict differs" % rank,
                                                          context)
    return check


def _check_elastic(per_epoch, epochs, batch=12, fit_epochs=3):
    """hvd.elastic.run's custom loop then its Keras fit: exit 0, the survivors finish both,
    equal digests, every step committed once, each sample once an epoch."""
    def check(proc, results, victims, killed, free, context):
        assert proc.returncode == 0, context
        others = _survivors(results, victims, context)
        assert len({r["digest"] for r in results.values()}) == 1, ("replicas differ", context)
        _sizes(results, others, context)
        steps = per_epoch * epochs
        for rank, r in results.items():
            assert r["returned"] == r["batch"] == r["iterations"] == steps, (rank, r, context)
            assert r["seen"] == [float(epochs)] * (per_epoch * batch), (
                "rank %d: a sample was lost or trained twice" % rank, context)
            assert r["sizes"] == sorted(r["sizes"], reverse=True), (rank, r["sizes"], context)
        fit = _results(proc.matex_out + ".fit")
        assert set(others) <= set(fit), ("a survivor did not finish fit", sorted(fit),
                                         context)
        assert len({r["digest"] for r in fit.values()}) == 1, ("fit's replicas differ", context)
        for rank, r in fit.items():
            assert (r["epoch"], r["batch"]) == (fit_epochs, 0), (rank, r, context)
            assert r["iterations"] == fit_epochs * per_epoch, (rank, r, context)
        # where the kill landed, for the campaign's count
        sizes, launches = results[min(results)]["sizes"], fit[min(fit)]["launches"]
        where = ("none" if not killed else "start-up" if sizes[0] < NRANKS
                 else "the loop" if sizes[-1] < NRANKS
                 else "fit" if len(launches) > 1 or launches[0][1] < NRANKS else "after")
        print("chaos: the kill landed in %s" % where)
    return check


# name: (script and arguments after OUT, the check of a run's end)
WORKLOADS = {
    "fit": (["ft_fit.py", "{out}", "300", "32", "3", "validate"], _check_training(300, 3, 30)),
    "loop": (["ft_custom_loop.py", "{out}", "300", "32", "3"], _check_training(300, 3, 30)),
    "localsgd": (["ft_localsgd.py", "{out}", "localsgd"], _check_training(300, 2, 20)),
    "predict": (["chaos_predict.py", "{out}", "4096", "3"], _check_predict(4096, 3)),
    "search": (["chaos_search.py", "{out}", "8", "2"], _check_search(8)),
    "pipeline": (["chaos_pipeline.py", "{out}", "3"], _check_pipeline(3, 256)),
    # a script written for Horovod (tests/scripts/elastic_loop.py), under --horovod
    "elastic": (["elastic_loop.py", "{out}", "150", "3", "fit"], _check_elastic(150, 3)),
}
FLAGS = {"elastic": ["--horovod"]}   # matexrun's flags beyond --ft -n 4, per workload
CHOSEN = [w.strip() for w in os.environ.get("MATEX_CHAOS_WORKLOADS",
                                            ",".join(WORKLOADS)).split(",") if w.strip()]


def _launch(workload, out):
    args, _ = WORKLOADS[workload]
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    cmd = [matexrun, "--ft", *FLAGS.get(workload, []), "-n", str(NRANKS),
           str(SCRIPTS / args[0])] + [
        a.format(out=out) for a in args[1:]]
    env = launch.launch_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    proc.matex_out = out
    return proc


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


def _fault_free(workload, tmp_path_factory):
    """(seconds, results) of a fault-free run of ``workload``: how long it takes once its
    ranks exist, and every rank's results, checked by the workload's own check (cached)."""
    if workload not in _free_runs:
        out = str(tmp_path_factory.mktemp("chaos-free-" + workload) / "r")
        proc = _launch(workload, out)
        deadline = time.time() + TIMEOUT
        script = WORKLOADS[workload][0][0]
        ranks = _wait_for_ranks(proc, script, deadline)
        started = time.time()
        stdout, err = _finish(proc, deadline)
        seconds = time.time() - started
        assert proc.returncode == 0 and len(ranks) == NRANKS, err[-4000:]
        results = _results(out)
        assert sorted(results) == list(range(NRANKS)), err[-4000:]
        WORKLOADS[workload][1](proc, results, [], [], None,
                               "the fault-free run of %s\n%s" % (workload, err[-4000:]))
        _free_runs[workload] = (seconds, results)
    return _free_runs[workload]


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
    duration, free = _fault_free(workload, tmp_path_factory)
    script, check = WORKLOADS[workload][0][0], WORKLOADS[workload][1]
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
    relaunched = re.findall(r"relaunching the job on (\d+) rank", err)
    if relaunched:   # killed while MPI started: the job ran again, ranks renumbered from 0
        print("chaos: relaunched on %s ranks" % relaunched[-1])
        victims = killed = list(range(int(relaunched[-1]), NRANKS))
    results = _results(out)
    print("chaos: ended: %s" % {r: (v.get("outcome", "finished"), v.get("size"))
                                for r, v in sorted(results.items())})
    try:
        check(proc, results, victims, killed, free, context)
    except AssertionError:
        print("chaos: the failed run's stderr (tail):\n" + err[-12000:])   # pytest cuts context
        raise


@pytest.mark.parametrize("where", ["start", "construct", "fit"])
def test_a_stage_lost_before_training_ends_the_pipeline_naming_it(tmp_path, where):
    """Rank 1 of a 3-stage pipeline on 3 ranks SIGKILLs itself during MaTEx's start-up
    (MaTEx drops it, and the 2 left cannot lay out the 3 stages: they raised a
    stage-count ValueError), or, of a 2-stage pipeline on 2 ranks, just before
    ``PipelineModel(...)`` (random kills land there whenever rank 1 is still starting
    while rank 0 already builds the pipeline) or just before ``pm.fit``: the others
    must end with ``RankFailure`` naming rank 1 (the promise of README's pipeline
    section), not a raw MPI error."""
    out = str(tmp_path / "r")
    nranks, args, env = 2, [out, "2", "1:" + where], None
    mpi_args = launch.ft_mpi_args()
    if where == "start":
        nranks, args = 3, [out, "2"]
        env = dict(os.environ, MATEX_INJECT_FAULT="rank=1,step=0,kind=kill,at=start")
        mpi_args = ["-x", "MATEX_INJECT_FAULT"] + mpi_args
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex",
                                     str(SCRIPTS / "chaos_pipeline.py")] + args,
                            mpi_args=mpi_args, env=env, timeout=300)
    results = _results(out)
    left = [r for r in range(nranks) if r != 1]
    assert sorted(results) == left, (sorted(results), proc.stderr[-3000:])
    assert {r["outcome"] for r in results.values()} == {"RankFailure"}, results
    _check_pipeline(2, 256, nranks=nranks)(proc, results, [1], [1], None,
                                           proc.stderr[-3000:])


@pytest.mark.parametrize("per_trial", [1, 2], ids=["groups-of-1", "groups-of-2"])
def test_a_rank_lost_as_the_search_starts_the_others_search(tmp_path, per_trial):
    """Rank 1 of 2 SIGKILLs itself just before ``matex.hpo.minimize`` (random kills land
    there whenever a rank is still starting while the others already build the
    search's groups): rank 0 must run the whole search (4 trials, each recorded once),
    with 2 ranks per trial as a group of one. Found by the search workload: the
    survivors ended with MPI_ERR_PROC_FAILED (the groups' raw Dup); then, once they
    shrank, 2 per trial had to divide the 1 left ('does not divide' on every
    survivor); now the groups are made as launched and the survivors regrouped, as a
    loss inside the search does."""
    out = str(tmp_path / "r")
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex",
                                str(SCRIPTS / "chaos_search.py"), out, "4", str(per_trial),
                                "1"],
                            mpi_args=launch.ft_mpi_args(), timeout=300)
    proc.matex_out = out
    results = _results(out)
    assert sorted(results) == [0], (sorted(results), proc.stderr[-3000:])
    _check_search(4, nranks=2)(proc, results, [1], [1], None, proc.stderr[-3000:])


def test_a_search_relaunched_on_fewer_ranks_keeps_its_groups(tmp_path):
    """Rank 1 of 4 dies before MPI starts; matexrun --ft relaunches the search on 3
    ranks. With 2 ranks per trial the 3 left used to fail 'ranks per trial (2) does not
    divide the number of ranks (3)' on every rank (campaign seed 14, run 52); now the
    groups are made for the 4 launched (the missing rank a lost member), and the
    search runs all its trials."""
    out = str(tmp_path / "r")
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    proc = subprocess.run([matexrun, "--ft", "--inject-fault", "rank=1,step=0,kind=kill,at=init",
                           "-n", str(NRANKS), str(SCRIPTS / "chaos_search.py"), out, "4", "2"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(launch.launch_env(), TF_CPP_MIN_LOG_LEVEL="2"))
    assert "relaunching the job on 3 rank(s)" in proc.stderr, proc.stderr[-3000:]
    proc.matex_out = out
    results = _results(out)
    assert sorted(results) == [0, 1, 2], (sorted(results), proc.stderr[-3000:])
    _check_search(4, nranks=3)(proc, results, [], [], None, proc.stderr[-3000:])
