"""Scaling of the training-step CNN: MaTEx against MultiWorkerMirroredStrategy, 1 to 16 ranks.

    python benchmarks/scaling.py                       # the rank counts this machine's cores allow
    python benchmarks/scaling.py --ranks 1,2,4,8,16    # on a 16-core node
    python benchmarks/scaling.py --ranks 1,2,4,8,16 --gpu   # also a 1-rank fit on the GPU
    python benchmarks/scaling.py --quick               # smoke run: 1 and 2 ranks, few steps

The model, data and steps are ``training_step.py``'s (a small CNN on synthetic
28x28x1 images, plain SGD). At each rank count N, two modes:

- ``weak``: the per-rank batch is fixed at 128 (global batch 128 N);
- ``strong``: the global batch is fixed at 128 (128 / N per rank).

At N = 1 both are the same run. Three kinds of process, each bound to one core
(``--bind-to core``; one hardware thread where the ranks outnumber the physical
cores, none where they outnumber the CPUs), with CUDA_VISIBLE_DEVICES="" so
that GPU TensorFlow cannot put every rank on one GPU:

- ``matex``: N ranks of ``import matex.keras as keras``: ``model.fit`` on a
  ``tf.data`` dataset of global batches, sliced per rank by MaTEx (the
  efficiency column is this fit's), and the custom ``tf.function`` loop of
  ``training_step.py`` with ``matex.DistributedOptimizer`` on each rank's part;
- ``mwms``: N workers of MultiWorkerMirroredStrategy (TF_CONFIG on localhost
  ports, CPU ring collectives over gRPC), the same custom loop, the global
  batch split by the strategy. Not ``fit``: Keras 3.15's fails under this
  strategy (keras-team/keras#20585);
- ``keras``: plain Keras in one process on one core (no MaTEx), for MaTEx's
  cost at one rank.

Efficiency is samples/s at N divided by N times samples/s at 1 rank, for the
same mode (weak: the ideal is N times the throughput; strong: N times the
speed). Figures are medians of interleaved measurements and of ``--repeats``
runs; a measurement of a fit is timed from the end of its first step to the
end of its last. With ``--gpu``, one process with the GPU visible runs plain
Keras's fit and MaTEx's fit (1 rank: the allreduce stages its tensors through
the host) to record what MaTEx costs with GPU TensorFlow.
"""

import argparse
import os
import sys

import _common

BATCH = 128            # the per-rank batch (weak) and the global batch (strong)
DEFAULT_RANKS = (1, 2, 4, 8, 16)
TARGET_RANKS = 16
MODES = ("weak", "strong")


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def parse_args():
    """``_common``'s options plus ``--ranks`` and ``--gpu``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=None,
                        help="comma-separated rank counts (default: those of %s that this "
                             "machine has cores for; --quick: 1,2)"
                             % ",".join(map(str, DEFAULT_RANKS)))
    parser.add_argument("--gpu", action="store_true",
                        help="also run plain Keras's and MaTEx's fit in 1 process with the GPU "
                             "visible")
    parser.add_argument("--quick", action="store_true",
                        help="1 and 2 ranks, few steps (smoke run, figures are rough)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="run every phase this many times, alternating, and keep the "
                             "median of each figure (default 2, 1 with --quick)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the merged results to PATH as JSON")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.ranks is None:
        args.ranks = [1, 2] if args.quick else [n for n in DEFAULT_RANKS if n <= cores()] or [1]
    else:
        try:
            args.ranks = sorted({int(n) for n in args.ranks.split(",") if n.strip()})
        except ValueError:
            parser.error("--ranks takes comma-separated whole numbers, not %r" % args.ranks)
        if not args.ranks or args.ranks[0] < 1:
            parser.error("--ranks needs rank counts >= 1")
    if 1 not in args.ranks:
        args.ranks = [1] + args.ranks     # the baseline of every efficiency
    return args


def settings(quick):
    """(steps per measurement, measurements per variant)."""
    return (6, 2) if quick else (30, 5)


def global_batch(mode, nranks):
    return BATCH * nranks if mode == "weak" else BATCH


def modes(nranks):
    """The modes measured at ``nranks`` (at 1 rank weak and strong are one run)."""
    return ("strong",) if nranks == 1 else MODES


# ---- workers ----------------------------------------------------------------

def hide_gpus(args):
    """CPU scaling runs: no rank may see a GPU (GPU TensorFlow would put all on GPU 0)."""
    if not args.gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def data(tf, part, parts, batch):
    """``training_step.py``'s synthetic images, enough for ``parts`` ranks of ``batch``."""
    import training_step as ts

    return ts.dataset(tf, part, parts, batch, samples=max(ts.SAMPLES, 2 * batch * parts))


def _placement(comm):
    """Cores each rank may run on (the most over ranks), and whether TF sees a GPU."""
    import tensorflow as tf

    return {"cores_per_rank": comm.allreduce(cores(), op=max_op()),
            "gpus_visible": len(tf.config.list_physical_devices("GPU"))}


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def _rates(seconds, batches):
    return {name: batches[name] / s for name, s in seconds.items()}


def worker_matex(args):
    """N ranks under ``matex.keras``: fit on global batches, and the custom loop, each mode."""
    hide_gpus(args)
    from mpi4py import MPI

    import matex
    import matex.keras as keras
    import tensorflow as tf
    import training_step as ts

    world = MPI.COMM_WORLD
    n, rank = matex.size(), matex.rank()
    steps, measurements = settings(args.quick)
    measures, batches = {}, {}
    for mode in modes(n):
        g = global_batch(mode, n)
        model = ts.build_model(keras)
        ts.compile_model(keras, model, keras.optimizers.SGD(0.01), jit_compile=False)
        # every rank builds the global batches; MaTEx keeps this rank's slice
        measures[mode + "_fit"] = ts.fit_measure(keras, model, data(tf, 0, 1, g), steps)
        model = ts.build_model(keras)
        optimizer = matex.DistributedOptimizer(keras.optimizers.SGD(0.01))
        optimizer.build(model.trainable_variables)   # eagerly: broadcasts rank 0's weights
        local = g // n
        measures[mode + "_loop"] = ts.loop_measure(tf, keras, model, optimizer,
                                                   data(tf, rank, n, local), steps, local)
        batches[mode + "_fit"] = batches[mode + "_loop"] = g
    seconds = _common.worst_over_ranks(world, _common.interleave(measures, measurements))
    _common.emit({"samples_per_s": _rates(seconds, batches), **_placement(world)}, rank)


def worker_mwms(args):
    """N workers of MultiWorkerMirroredStrategy (ring), the custom loop, each mode."""
    hide_gpus(args)
    strategy = _common.mwms_strategy()
    import keras
    import tensorflow as tf
    import training_step as ts
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    n = world.Get_size()
    steps, measurements = settings(args.quick)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    measures, batches = {}, {}
    for mode in modes(n):
        g = global_batch(mode, n)
        with strategy.scope():
            model = ts.build_model(keras)
            optimizer = keras.optimizers.SGD(0.01)
            optimizer.build(model.trainable_variables)
        dataset = data(tf, 0, 1, g).with_options(options)
        measures[mode + "_loop"] = ts.loop_measure(tf, keras, model, optimizer, dataset, steps,
                                                   g, strategy)
        batches[mode + "_loop"] = g
    seconds = _common.worst_over_ranks(world, _common.interleave(measures, measurements))
    _common.emit({"samples_per_s": _rates(seconds, batches), **_placement(world)},
                 world.Get_rank())


def worker_keras(args):
    """Plain Keras, one process (one core, or the GPU with ``--gpu``): fit and custom loop."""
    hide_gpus(args)
    import keras
    import tensorflow as tf
    import training_step as ts
    from mpi4py import MPI

    steps, measurements = settings(args.quick)
    model = ts.build_model(keras)
    ts.compile_model(keras, model, keras.optimizers.SGD(0.01), jit_compile=False)
    measures = {"fit": ts.fit_measure(keras, model, data(tf, 0, 1, BATCH), steps)}
    if not args.gpu:
        model = ts.build_model(keras)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
        measures["loop"] = ts.loop_measure(tf, keras, model, optimizer, data(tf, 0, 1, BATCH),
                                           steps, BATCH)
    seconds = _common.interleave(measures, measurements)
    result = {"samples_per_s": _rates(seconds, dict.fromkeys(seconds, BATCH)),
              **_placement(MPI.COMM_WORLD)}
    if args.gpu:
        result["device"] = model.weights[0].value.device
    _common.emit(result)


def worker_gpu_matex(args):
    """One rank of ``matex.keras`` with the GPU visible: fit, as ``worker_keras --gpu``."""
    from mpi4py import MPI

    import matex.keras as keras
    import tensorflow as tf
    import training_step as ts

    steps, measurements = settings(args.quick)
    model = ts.build_model(keras)
    ts.compile_model(keras, model, keras.optimizers.SGD(0.01), jit_compile=False)
    seconds = _common.interleave({"fit": ts.fit_measure(keras, model, data(tf, 0, 1, BATCH),
                                                        steps)}, measurements)
    _common.emit({"samples_per_s": _rates(seconds, {"fit": BATCH}),
                  "device": model.weights[0].value.device, **_placement(MPI.COMM_WORLD)})


WORKERS = {"matex": worker_matex, "mwms": worker_mwms, "keras": worker_keras,
           "gpu_matex": worker_gpu_matex}


# ---- driver -----------------------------------------------------------------

def physical_cores():
    """Physical cores among the CPUs this process may use (logical CPUs when unknown)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    found, cpu, package = set(), None, None
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id" and (allowed is None or cpu in allowed):
                    found.add((package, value))
    except (OSError, ValueError):
        pass
    return len(found) or cores()


def binding(nranks):
    """One core per rank where the machine has the cores; else one hardware thread; else none."""
    if nranks <= physical_cores():
        return ["--bind-to", "core", "--map-by", "core"]
    if nranks <= cores():
        return ["--bind-to", "hwthread", "--map-by", "hwthread"]
    return ["--bind-to", "none"]


def run_all(args):
    """Every phase, ``--repeats`` times alternating; results by rank count."""
    extra = ["--quick"] if args.quick else []
    phases = {"keras": ("keras", dict(nranks=1, args=extra, mpi_args=binding(1)))}
    for n in args.ranks:
        for kind in ("matex", "mwms"):
            phases["%s%d" % (kind, n)] = (kind, dict(nranks=n, args=extra, mpi_args=binding(n)))
    if args.gpu:
        gpu = dict(nranks=1, args=extra + ["--gpu"], mpi_args=["--bind-to", "none"])
        phases["gpu_keras"] = ("keras", gpu)
        phases["gpu_matex"] = ("gpu_matex", gpu)
    runs = {name: [] for name in phases}
    for _ in range(args.repeats):
        for name, (worker, spec) in phases.items():
            runs[name].append(_common.run_phase(__file__, worker, **spec))
    merged = {}
    for name, results in runs.items():
        merged[name] = _common.median_merge(
            [{k: v for k, v in r.items() if k != "device"} for r in results])
        if "device" in results[0]:
            merged[name]["device"] = results[0]["device"]
    return merged


def gpu_description():
    """The GPUs TensorFlow sees in this (driver) process, in words."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "no GPU visible to TensorFlow"
    names = []
    for gpu in gpus:
        try:
            names.append(tf.config.experimental.get_device_details(gpu).get("device_name", "GPU"))
        except (ValueError, RuntimeError):
            names.append("GPU")
    return "%d GPU(s) visible to TensorFlow: %s" % (len(gpus), ", ".join(names))


def efficiency(results, mode, n, kind="fit"):
    """Samples/s at ``n`` ranks over ``n`` times those at 1 rank (same mode, same step)."""
    base = results["matex1"]["samples_per_s"]["strong_" + kind]
    mode = "strong" if n == 1 else mode
    return results["matex%d" % n]["samples_per_s"]["%s_%s" % (mode, kind)] / (n * base)


def report(results, ranks, machine_cores):
    """The table, the targets, and the notes under them."""
    rows = []
    for n in ranks:
        for mode in MODES:
            key = "strong" if n == 1 else mode
            matex, mwms = results["matex%d" % n]["samples_per_s"], results["mwms%d" % n][
                "samples_per_s"]
            rows.append([str(n), mode, str(global_batch(mode, n)),
                         "%.0f" % matex[key + "_fit"], "%.2f" % efficiency(results, mode, n),
                         "%.0f" % matex[key + "_loop"], "%.0f" % mwms[key + "_loop"],
                         "%.2f" % (matex[key + "_fit"] / mwms[key + "_loop"]),
                         "%.2f" % (matex[key + "_loop"] / mwms[key + "_loop"])])
    lines = [_common.table(["ranks", "mode", "global batch", "MaTEx fit samples/s",
                            "efficiency", "MaTEx loop samples/s", "MWMS loop samples/s",
                            "MaTEx fit / MWMS", "MaTEx loop / MWMS"], rows), ""]
    largest = max(ranks)
    valid = TARGET_RANKS in ranks and machine_cores >= TARGET_RANKS
    if valid:
        eff = efficiency(results, "weak", TARGET_RANKS)
        lines.append(_common.target(
            "weak-scaling efficiency at 16 ranks >= 90 %", eff >= 0.9,
            "%.0f %% at 16 ranks, MaTEx fit, per-rank batch %d" % (100 * eff, BATCH)))
        matex = results["matex16"]["samples_per_s"]
        mwms = results["mwms16"]["samples_per_s"]
        worst = min(matex[m + "_loop"] / mwms[m + "_loop"] for m in MODES)
        lines.append(_common.target(
            "MaTEx >= 1.5x MWMS samples/s at 16 ranks", worst >= 1.5,
            "same custom loop: %s; MaTEx fit vs MWMS loop: %s" % (
                ", ".join("%s %.2fx" % (m, matex[m + "_loop"] / mwms[m + "_loop"])
                          for m in MODES),
                ", ".join("%s %.2fx" % (m, matex[m + "_fit"] / mwms[m + "_loop"])
                          for m in MODES))))
    else:
        why = ("not measured: largest run %d ranks on a %d-core machine" % (largest, machine_cores)
               if largest < TARGET_RANKS else
               "not a valid measurement: 16 ranks ran oversubscribed on %d cores" % machine_cores)
        at = largest if largest < TARGET_RANKS else max(
            [n for n in ranks if n <= machine_cores] or [1])
        matex = results["matex%d" % at]["samples_per_s"]
        mwms = results["mwms%d" % at]["samples_per_s"]
        key = "weak" if at > 1 else "strong"
        lines.append(_common.target(
            "weak-scaling efficiency at 16 ranks >= 90 %", False,
            "%s; at %d ranks: %.0f %%" % (why, at, 100 * efficiency(results, "weak", at))))
        lines.append(_common.target(
            "MaTEx >= 1.5x MWMS samples/s at 16 ranks", False,
            "%s; at %d ranks, weak, same custom loop: %.2fx, MaTEx fit vs MWMS loop: %.2fx"
            % (why, at, matex[key + "_loop"] / mwms[key + "_loop"],
               matex[key + "_fit"] / mwms[key + "_loop"])))
    lines.append("")
    keras_rate = results["keras"]["samples_per_s"]
    one = results["matex1"]["samples_per_s"]
    lines.append("MaTEx at 1 rank against plain Keras on one core: fit %.2fx, custom loop %.2fx "
                 "(%.0f and %.0f samples/s)." % (
                     one["strong_fit"] / keras_rate["fit"], one["strong_loop"] / keras_rate["loop"],
                     keras_rate["fit"], keras_rate["loop"]))
    per_rank = max(results[name]["cores_per_rank"] for name in results
                   if name.startswith(("matex", "mwms")))
    visible = max(results[name]["gpus_visible"] for name in results
                  if name.startswith(("matex", "mwms", "keras")))
    lines.append("Cores each rank could run on: %d; GPUs the CPU runs saw: %d "
                 "(CUDA_VISIBLE_DEVICES=\"\")." % (per_rank, visible))
    lines.append("MWMS runs the custom loop: Keras 3.15 fit fails under it "
                 "(keras-team/keras#20585).")
    if "gpu_matex" in results:
        plain, through = results["gpu_keras"], results["gpu_matex"]
        if plain["gpus_visible"]:
            lines.append("GPU, 1 process, fit, batch %d: plain Keras %.0f samples/s (weights on "
                         "%s), through MaTEx (1 rank, allreduce staged through the host) %.0f "
                         "samples/s: %.2fx." % (
                             BATCH, plain["samples_per_s"]["fit"], plain["device"],
                             through["samples_per_s"]["fit"],
                             through["samples_per_s"]["fit"] / plain["samples_per_s"]["fit"]))
        else:
            lines.append("--gpu: no GPU visible to TensorFlow; the GPU phases ran on the CPU "
                         "(plain Keras %.0f, through MaTEx %.0f samples/s)." % (
                             plain["samples_per_s"]["fit"], through["samples_per_s"]["fit"]))
    return "\n".join(lines)


def main():
    """Driver (no ``--worker``) or one worker phase."""
    args = parse_args()
    if args.worker:
        return WORKERS[args.worker](args)
    threads = [n for n in args.ranks if physical_cores() < n <= cores()]
    if threads:
        print("note: %s ranks exceed this machine's %d physical cores: bound one hardware "
              "thread each" % (",".join(map(str, threads)), physical_cores()), file=sys.stderr)
    over = [n for n in args.ranks if n > cores()]
    if over:
        print("note: %s ranks exceed this machine's %d cores: run oversubscribed, unbound"
              % (",".join(map(str, over)), cores()), file=sys.stderr)
    results = run_all(args)
    command = "python benchmarks/scaling.py --ranks %s%s%s" % (
        ",".join(map(str, args.ranks)), " --gpu" if args.gpu else "",
        " --quick" if args.quick else "")
    print(_common.header("scaling: training-step CNN, weak (batch %d per rank) and strong "
                         "(global batch %d)" % (BATCH, BATCH), command))
    print("Machine: %d logical CPUs, %d physical cores (CPU model above); %s."
          % (cores(), physical_cores(), gpu_description()))
    print("")
    print(report(results, args.ranks, cores()))
    results["machine"] = {"cores": cores(), "ranks": args.ranks}
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
