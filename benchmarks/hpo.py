"""MaTEx's search algorithms: the lazy GP's update cost, and search quality on analytic functions.

    python benchmarks/hpo.py            # full run
    python benchmarks/hpo.py --quick    # smoke run
    python benchmarks/hpo.py --algorithms lazy_bo,random,genetic   # leave out Keras Tuner BO
    python benchmarks/hpo.py --algorithms kt_bo,lazy_bo --budgets 40   # shorter searches
    python benchmarks/hpo.py --parallel 4   # lazy GP: 1 worker vs 4 asynchronous workers
    python benchmarks/hpo.py --parallel 4 --functions hartmann6 --budgets 40   # one cell

One process, no MPI (the oracles are pure Python; the distributed search is
measured elsewhere). BLAS runs on one thread (OPENBLAS_NUM_THREADS=1 unless
set), so that timings on a shared machine are not thread-contention noise.

1. LazyGP update vs full refactorisation. A GP (Matern 5/2, 6 inputs, fixed
   kernel hyperparameters) holds n observations; the time of taking one more:
   ``add`` (the O(n^2) extension of the Cholesky factor) against a fresh O(n^3)
   factorisation of the n+1 x n+1 covariance (building K, Cholesky, solves:
   what a GP without the lazy update does per result). Medians of repeated
   measurements; the growth exponent between sizes is log(t2/t1)/log(n2/n1).
   The O(n^2) check takes ``add`` at 4000 and 8000 observations: from 1000 to
   4000 the factor leaves the last-level cache (here 32 MB), which steepens
   the exponent between those sizes (measured: 2.01 from 1000 to 2000, 2.87
   from 2000 to 4000, 2.16 from 4000 to 8000).
2. Search quality: the best value found after 40 and 100 evaluations of
   Branin (2-d, minimum 0.397887) and Hartmann-6 (minimum -3.32237), median
   over 10 seeds, for Keras Tuner's RandomSearch and BayesianOptimization
   oracles, LazyBayesianOracle and GeneticOracle, each driven sequentially
   through create_trial / update_trial / end_trial. Seeds are 1 + 7919 k: Keras
   Tuner's samplers count their seed up by one per draw, so nearby seeds would
   share draws.

3. ``--parallel W`` (instead of 1 and 2): LazyBayesianOracle alone, one
   worker against W asynchronous workers, same seeds and budgets. The workers
   are simulated in one process as the service runs them (matex.hpo._service:
   a group's result and its next request are one ``end_trial`` then
   ``create_trial``): W trials are in flight; each trial takes a duration
   drawn uniformly from [0.5, 1.5] (seeded); the first to finish is reported
   and its group asks for the next trial while the W - 1 others still run.
   Target: the W-worker median within 10 % of the one-worker median, every
   budget: on Branin (values > 0) as values, median(W) <= 1.1 x median(1);
   on Hartmann-6 (values < 0, minimum -3.32237) as gaps to the minimum,
   gap(W) <= 1.1 x gap(1).

Targets: add >= 20x faster than refactorising at n = 1000, with O(n^2) growth;
LazyBayesian's median best at least Keras Tuner BO's; both better than random.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import math  # noqa: E402
import sys  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import _common  # noqa: E402

# `make` installs scikit-learn here, off the virtualenv's path (Keras imports it in every
# process where it is importable, 1.2 s of each TensorFlow start-up)
BENCH_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          ".venv", "bench-site")


def need_scikit_learn():
    """Keras Tuner's BayesianOptimization imports scikit-learn: find it, or say how to get it."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        if not os.path.isdir(os.path.join(BENCH_SITE, "sklearn")):
            raise SystemExit("--algorithms kt_bo: Keras Tuner's BayesianOptimization needs "
                             "scikit-learn, not found (pip install 'matex[bench]', or `make` "
                             "puts it in %s); --algorithms lazy_bo,random,genetic leaves it out"
                             % BENCH_SITE)
        sys.path.append(BENCH_SITE)   # after the virtualenv; spawned workers inherit sys.path
    try:            # here, not in a worker: Keras Tuner hides the reason behind its own message
        import sklearn.gaussian_process  # noqa: F401
    except ImportError as error:
        raise SystemExit("--algorithms kt_bo: scikit-learn does not import: %s (its "
                         "requirements; `make` installs them in %s)" % (error, BENCH_SITE))


ALGORITHMS = {   # name: description
    "random": "Keras Tuner RandomSearch",
    "kt_bo": "Keras Tuner BayesianOptimization",
    "lazy_bo": "MaTEx LazyBayesianOracle",
    "genetic": "MaTEx GeneticOracle",
}
FUNCTIONS = {"branin": (2, 0.397887), "hartmann6": (6, -3.32237)}   # dims, known minimum
_HARTMANN_A = [[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14],
               [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]]
_HARTMANN_P = [[0.1312, 0.1696, 0.5569, 0.0124, 0.8283, 0.5886],
               [0.2329, 0.4135, 0.8307, 0.3736, 0.1004, 0.9991],
               [0.2348, 0.1451, 0.3522, 0.2883, 0.3047, 0.6650],
               [0.4047, 0.8828, 0.8732, 0.5743, 0.1091, 0.0381]]
_HARTMANN_ALPHA = [1.0, 1.2, 3.0, 3.2]


def branin(x1, x2):
    """Branin-Hoo on [-5, 10] x [0, 15]; minimum 0.397887 (three places)."""
    b, c, t = 5.1 / (4 * math.pi ** 2), 5 / math.pi, 1 / (8 * math.pi)
    return (x2 - b * x1 ** 2 + c * x1 - 6) ** 2 + 10 * (1 - t) * math.cos(x1) + 10


def hartmann6(*x):
    """Hartmann-6 on [0, 1]^6; minimum -3.32237."""
    total = 0.0
    for alpha, a, p in zip(_HARTMANN_ALPHA, _HARTMANN_A, _HARTMANN_P):
        total -= alpha * math.exp(-sum(ai * (xi - pi) ** 2 for ai, xi, pi in zip(a, x, p)))
    return total


def space(function):
    """The function's search space, as Keras Tuner hyperparameters."""
    import keras_tuner as kt

    hp = kt.HyperParameters()
    if function == "branin":
        hp.Float("x1", -5.0, 10.0)
        hp.Float("x2", 0.0, 15.0)
    else:
        for i in range(6):
            hp.Float("x%d" % i, 0.0, 1.0)
    return hp


def evaluate(function, values):
    if function == "branin":
        return branin(values["x1"], values["x2"])
    return hartmann6(*(values["x%d" % i] for i in range(6)))


def make_oracle(algorithm, function, seed, max_trials):
    import keras_tuner as kt

    from matex.hpo import GeneticOracle, LazyBayesianOracle

    common = dict(objective=kt.Objective("score", "min"), max_trials=max_trials, seed=seed,
                  hyperparameters=space(function))
    if algorithm == "random":
        return kt.oracles.RandomSearchOracle(**common)
    if algorithm == "kt_bo":
        return kt.oracles.BayesianOptimizationOracle(**common)
    if algorithm == "lazy_bo":
        return LazyBayesianOracle(**common)
    return GeneticOracle(**common)


def search(task):
    """One search: (algorithm, function, seed, budget) -> best value after each evaluation."""
    import tempfile
    import warnings

    from matex import _compat

    algorithm, function, seed, budget = task
    warnings.filterwarnings("ignore")        # sklearn's convergence warnings (Keras Tuner BO)
    oracle = make_oracle(algorithm, function, seed, budget)
    with tempfile.TemporaryDirectory() as directory:
        _compat.set_oracle_project_dir(oracle, directory, "search")
        oracle.verbose = 0
        best, trace = math.inf, []
        start = time.perf_counter()
        for _ in range(budget):
            trial = oracle.create_trial("driver")
            if trial.status != "RUNNING":
                break
            best = min(best, finish(oracle, trial, function))
            trace.append(best)
        seconds = time.perf_counter() - start
    return {"trace": trace, "s_per_trial": seconds / max(len(trace), 1)}


def finish(oracle, trial, function):
    """Evaluate ``trial`` and report it to ``oracle`` as a worker would; returns the value."""
    value = evaluate(function, trial.hyperparameters.values)
    oracle.update_trial(trial.trial_id, {"score": value})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)
    return value


def search_async(task):
    """(function, seed, budget, workers) -> best value after each evaluation, ``workers``
    trials in flight (simulated: see the module doc, 3.)."""
    import heapq
    import random
    import tempfile
    import warnings

    from matex import _compat

    function, seed, budget, workers = task
    warnings.filterwarnings("ignore")
    oracle = make_oracle("lazy_bo", function, seed, budget)
    durations = random.Random(seed)
    with tempfile.TemporaryDirectory() as directory:
        _compat.set_oracle_project_dir(oracle, directory, "search")
        oracle.verbose = 0
        running, now, best, trace = [], 0.0, math.inf, []

        def start(worker):
            trial = oracle.create_trial("worker-%d" % worker)
            if trial.status == "RUNNING":
                heapq.heappush(running, (now + durations.uniform(0.5, 1.5), worker, trial))

        begin = time.perf_counter()
        for worker in range(workers):
            start(worker)
        while running:
            now, worker, trial = heapq.heappop(running)
            best = min(best, finish(oracle, trial, function))
            trace.append(best)
            start(worker)
        seconds = time.perf_counter() - begin
    return {"trace": trace, "s_per_trial": seconds / max(len(trace), 1)}


def parallel(args, workers):
    """Median and worst best value per function, budget and number of workers (1 and W)."""
    import multiprocessing

    seeds = [1 + 7919 * k for k in range(2 if args.quick else 10)]
    budgets = (12, 20) if args.quick else tuple(args.budgets)
    tasks = [(f, s, budgets[-1], w) for f in args.functions for w in (1, workers)
             for s in seeds]
    processes = min(len(tasks), len(os.sched_getaffinity(0)))
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        done = pool.map(search_async, tasks, chunksize=1)
    out = {}
    for (function, _, _, w), run in zip(tasks, done):
        entry = out.setdefault(function, {}).setdefault(str(w), {str(b): [] for b in budgets})
        for b in budgets:
            entry[str(b)].append(run["trace"][min(b, len(run["trace"])) - 1])
    return {"seeds": len(seeds), "budgets": list(budgets), "workers": workers, "best": out}


def report_parallel(results):
    workers, budgets = results["workers"], [str(b) for b in results["budgets"]]
    rows, checks = [], []
    for function, (_, minimum) in FUNCTIONS.items():
        if function not in results["best"]:
            continue   # left out (--functions)
        for b in budgets:
            one = results["best"][function]["1"][b]
            many = results["best"][function][str(workers)][b]
            gaps = [statistics.median(v) - minimum for v in (one, many)]
            rows.append([function, b, "%.4f" % statistics.median(one), "%.4f" % max(one),
                         "%.4f" % statistics.median(many), "%.4f" % max(many),
                         "%.4f" % gaps[0], "%.4f" % gaps[1]])
            if function == "branin":
                checks.append((function, b, "value", statistics.median(one),
                               statistics.median(many)))
            else:
                checks.append((function, b, "gap", gaps[0], gaps[1]))
    lines = ["Lazy GP, 1 worker vs %d asynchronous workers (simulated): best value, %d seeds"
             % (workers, results["seeds"]), "",
             _common.table(["function", "evaluations", "1: median", "1: worst",
                            "%d: median" % workers, "%d: worst" % workers, "1: gap",
                            "%d: gap" % workers], rows), "", "Targets:",
             _common.target("%d workers' median within 10 %% of one worker's, every budget "
                            "(Branin: median value; Hartmann-6: median gap to the minimum)"
                            % workers, all(many <= 1.1 * one for *_, one, many in checks),
                            "; ".join("%s @%s %s %.4f (1) vs %.4f (W)" % row
                                      for row in checks))]
    return "\n".join(lines)


def quality(args):
    """Median best value after each budget, per function and algorithm."""
    import multiprocessing

    seeds = [1 + 7919 * k for k in range(2 if args.quick else 10)]
    budgets = (6, 12) if args.quick else tuple(args.budgets)
    tasks = [(a, f, s, budgets[-1]) for f in args.functions for a in args.algorithms
             for s in seeds]
    workers = min(len(tasks), len(os.sched_getaffinity(0)))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = pool.map(search, tasks, chunksize=1)
    results = {}
    for (algorithm, function, _, _), run in zip(tasks, done):
        entry = results.setdefault(function, {}).setdefault(
            algorithm, {"best": {str(b): [] for b in budgets}, "s_per_trial": []})
        for b in budgets:
            entry["best"][str(b)].append(run["trace"][min(b, len(run["trace"])) - 1])
        entry["s_per_trial"].append(run["s_per_trial"])
    summary = {}
    for function, algorithms in results.items():
        for algorithm, entry in algorithms.items():
            summary.setdefault(function, {})[algorithm] = {
                "median_best": {b: statistics.median(v) for b, v in entry["best"].items()},
                "s_per_trial": statistics.median(entry["s_per_trial"])}
    return {"seeds": len(seeds), "budgets": list(budgets), "functions": summary}


def gp_update(args):
    """Seconds per new observation at each n: lazy ``add`` vs a fresh factorisation."""
    import numpy as np

    from matex.hpo import LazyGP

    sizes = (100, 200, 400) if args.quick else (250, 1000, 4000)
    rng = np.random.default_rng(0)
    dim = 6
    out = {}
    for n in sizes:
        X, y = rng.random((n + 1, dim)), rng.standard_normal(n + 1)
        gp = LazyGP(dim, length_scales=np.full(dim, 0.4), noise=1e-3)
        gp.set_data(X[:n], y[:n])

        def lazy():
            start = time.perf_counter()
            gp.add(X[n], y[n])
            elapsed = time.perf_counter() - start
            gp.truncate(n)
            return elapsed

        full_gp = LazyGP(dim, length_scales=np.full(dim, 0.4), noise=1e-3)
        full_gp.set_data(X, y)

        def full():
            start = time.perf_counter()
            full_gp.refactor()
            return time.perf_counter() - start

        rounds = 3 if n >= 4000 else (5 if args.quick else 15)
        lazy_s = statistics.median(lazy() for _ in range(max(rounds, 15)))
        full_s = statistics.median(full() for _ in range(rounds))
        out[str(n)] = {"lazy_s": lazy_s, "full_s": full_s}
    # growth of add alone at twice the largest size: from 1000 to 4000 the packed factor
    # leaves the last-level cache (packed float64: 4 MB -> 64 MB), a step in
    # the constant that the exponent would take for a higher order
    n = 2 * sizes[-1]
    X, y = rng.random((n + 1, dim)), rng.standard_normal(n + 1)
    gp = LazyGP(dim, length_scales=np.full(dim, 0.4), noise=1e-3)
    gp.set_data(X[:n], y[:n])
    growth = {str(sizes[-1]): out[str(sizes[-1])]["lazy_s"],
              str(n): statistics.median(lazy() for _ in range(15))}
    return {"sizes": list(sizes), "per_observation": out, "add_growth": growth}


def exponent(times, sizes, key):
    """Growth exponent of ``times[n][key]`` between consecutive sizes."""
    return [math.log(times[str(b)][key] / times[str(a)][key]) / math.log(b / a)
            for a, b in zip(sizes, sizes[1:])]


def report(results):
    gp, qual = results["gp_update"], results["quality"]
    sizes, per = gp["sizes"], gp["per_observation"]
    rows = [["%d" % n, "%.3f" % (1e3 * per[str(n)]["lazy_s"]),
             "%.3f" % (1e3 * per[str(n)]["full_s"]),
             "%.1f" % (per[str(n)]["full_s"] / per[str(n)]["lazy_s"])] for n in sizes]
    lines = ["LazyGP: time per new observation (6 inputs, one BLAS thread)", "",
             _common.table(["n", "add ms", "refactorisation ms", "speed-up x"], rows), ""]
    lazy_exp, full_exp = exponent(per, sizes, "lazy_s"), exponent(per, sizes, "full_s")
    small, large = sorted(gp["add_growth"], key=int)
    growth_exp = math.log(gp["add_growth"][large] / gp["add_growth"][small]) / math.log(
        int(large) / int(small))
    lines.append("Growth exponents between sizes: add %s, refactorisation %s."
                 % (", ".join("%.2f" % e for e in lazy_exp),
                    ", ".join("%.2f" % e for e in full_exp)))
    budgets = [str(b) for b in qual["budgets"]]
    rows = []
    for function, (_, minimum) in FUNCTIONS.items():
        if function not in qual["functions"]:
            continue   # left out (--functions)
        for algorithm, description in ALGORITHMS.items():
            entry = qual["functions"][function].get(algorithm)
            if entry is None:
                continue   # left out (--algorithms)
            rows.append([function, description]
                        + ["%.4f" % entry["median_best"][b] for b in budgets]
                        + ["%.4f" % (entry["median_best"][budgets[-1]] - minimum),
                           "%.3f" % entry["s_per_trial"]])
    lines += ["", "Search quality: median best value over %d seeds (minimisation)"
              % qual["seeds"], "",
              _common.table(["function", "algorithm"] + ["best @%s" % b for b in budgets]
                            + ["gap @%s" % budgets[-1], "oracle s/trial"], rows), ""]
    middle = str(sizes[1])
    speedup = per[middle]["full_s"] / per[middle]["lazy_s"]
    functions = [f for f in FUNCTIONS if f in qual["functions"]]
    ran = [a for a in ALGORITHMS if a in qual["functions"][functions[0]]]
    med = {f: {a: qual["functions"][f][a]["median_best"] for a in ran} for f in functions}
    lazy_vs_kt = [(f, b, med[f]["lazy_bo"][b], med[f]["kt_bo"][b])
                  for f in functions for b in budgets if {"lazy_bo", "kt_bo"} <= set(ran)]
    beat = [(f, b, a, med[f][a][b], med[f]["random"][b])
            for f in functions for b in budgets for a in ("lazy_bo", "kt_bo")
            if {a, "random"} <= set(ran)]
    lines += ["Targets:", _common.target(
        "LazyGP add >= 20x faster than refactorisation at n = %s" % middle, speedup >= 20,
        "%.1fx: %.3f ms vs %.3f ms" % (speedup, 1e3 * per[middle]["lazy_s"],
                                       1e3 * per[middle]["full_s"])),
        _common.target(
        "LazyGP add grows as O(n^2) (exponent <= 2.3 from n = %s to %s, both factors past "
        "the cache)" % tuple(sorted(gp["add_growth"], key=int)), growth_exp <= 2.3,
        "exponent %.2f (%s ms); between the table's sizes %s; refactorisation %s"
        % (growth_exp, " -> ".join("%.3f" % (1e3 * gp["add_growth"][k])
                                   for k in sorted(gp["add_growth"], key=int)),
           ", ".join("%.2f" % e for e in lazy_exp), ", ".join("%.2f" % e for e in full_exp))),
        _common.target(
        "LazyBayesian median best <= Keras Tuner BO's, every function and budget",
        all(lazy <= kt for _, _, lazy, kt in lazy_vs_kt),
        "; ".join("%s @%s %.4f vs %.4f" % row for row in lazy_vs_kt))
        if lazy_vs_kt else "- not measured: LazyBayesian vs Keras Tuner BO (not both run)",
        _common.target(
        "LazyBayesian and Keras Tuner BO beat random search, every function and budget",
        all(v < r for *_, v, r in beat),
        "; ".join("%s @%s %s %.4f vs %.4f" % row for row in beat))
        if beat else "- not measured: BO vs random search (not both run)"]
    return "\n".join(lines)


def _own_option(name, default):
    """``name VALUE`` taken out of sys.argv (options of this driver only: the parser is shared)."""
    if name not in sys.argv:
        return default
    at = sys.argv.index(name)
    value = sys.argv[at + 1] if at + 1 < len(sys.argv) else ""
    del sys.argv[at:at + 2]
    return value.split(",")


def main():
    names = _own_option("--algorithms", list(ALGORITHMS))
    unknown = [n for n in names if n not in ALGORITHMS]
    if not names or unknown:
        raise SystemExit("--algorithms: a comma-separated list of %s, not %r"
                         % (", ".join(ALGORITHMS), ",".join(names)))
    functions = _own_option("--functions", list(FUNCTIONS))
    if not functions or any(f not in FUNCTIONS for f in functions):
        raise SystemExit("--functions: a comma-separated list of %s, not %r"
                         % (", ".join(FUNCTIONS), ",".join(functions)))
    budgets = _own_option("--budgets", ["40", "100"])
    if not all(b.isdigit() and int(b) > 0 for b in budgets):
        raise SystemExit("--budgets: comma-separated numbers of evaluations, not %r"
                         % ",".join(budgets))
    workers = _own_option("--parallel", None)
    if workers is not None and not (len(workers) == 1 and workers[0].isdigit()
                                    and int(workers[0]) > 1):
        raise SystemExit("--parallel: a number of workers above 1, not %r" % ",".join(workers))
    args = _common.parse_args(__doc__.splitlines()[0], [], repeats=1)
    args.algorithms, args.budgets = names, sorted(int(b) for b in budgets)
    args.functions = [f for f in FUNCTIONS if f in functions]
    only = (" --functions " + ",".join(args.functions)
            if args.functions != list(FUNCTIONS) else "")
    if workers is None and "kt_bo" in names:
        need_scikit_learn()
    if workers is not None:
        workers = int(workers[0])
        results = {"parallel": parallel(args, workers)}
        command = "python benchmarks/hpo.py --parallel %d" % workers + (
            " --quick" if args.quick else "") + (
            " --budgets " + ",".join(map(str, args.budgets)) if args.budgets != [40, 100] else ""
        ) + only
        print(_common.header("hyperparameter search: lazy GP, 1 vs %d asynchronous workers"
                             % workers, command))
        print(report_parallel(results["parallel"]))
        _common.write_json(args.json, results)
        return
    results = {"gp_update": gp_update(args), "quality": quality(args)}
    command = "python benchmarks/hpo.py" + (" --quick" if args.quick else "") + (
        " --algorithms " + ",".join(names) if names != list(ALGORITHMS) else "") + (
        " --budgets " + ",".join(map(str, args.budgets)) if args.budgets != [40, 100] else ""
    ) + only
    print(_common.header("hyperparameter search: lazy GP and oracles, one process", command))
    print(report(results))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
