"""Model parallelism: tensor split, pipeline bubble and memory per rank (issue #13).

    python benchmarks/model_parallel.py [--quick] [--only tensor|pipeline|memory]

**pipeline** (bubble): an MLP of P stages (two Dense layers per stage, sized so
one stage's forward + backward on a batch takes >= 20 ms on one core) trained
with ``PipelineModel`` on P ranks for M micro-batches. Reference, measured in
the same run: the whole model's plain Keras train step in one process
(``t1``). A perfect P-stage pipeline needs ``t1 / P x (M + P - 1) / M`` per
step (GPipe's bubble); the table prints measured / (t1 / P) next to that
ideal ratio. Every rank uses one TensorFlow thread. On a machine with fewer
cores than ranks (P = 4 on 2 cores) the ranks share cores and the measured
ratio includes that oversubscription (P / cores), which the table says.

**memory**: a model of W parameter bytes trained with Adam (weights +
gradients + two moments = 4 W per full replica) on R ranks, as R pipeline
stages (an unbuilt Sequential: each rank builds only its stage) against R
data-parallel replicas. Per rank: the peak resident memory grown while
building and training (Linux VmHWM, reset through /proc/self/clear_refs after
TensorFlow and MaTEx have started), and, for the pipeline, while ``save``
writes the whole model as one ``.keras`` file (reset again before it). The cap
is 3 W over that start: data parallelism (>= 4 W) must exceed it, the pipeline
(4 W / R + activations and TensorFlow's tracing, ~200 MB per rank here) must
fit under it. The cap is checked, not enforced (RLIMIT_AS would also count TensorFlow's reserved but
untouched address space).

**tensor**: a 2-way ``ColumnParallelDense`` + ``RowParallelDense`` split
against the replicated (data-parallel) block on 2 ranks: step time, bytes to
collectives per step, parameter bytes per rank (``_mp_tensor.py``).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import _mp_tensor  # noqa: E402 - the tensor-parallel section

SECTIONS = ("tensor", "pipeline", "memory")


def _parse():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P = 2 only, small sizes")
    parser.add_argument("--only", choices=SECTIONS, default=None)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--micro", default="1,4,16", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="pipeline", help=argparse.SUPPRESS)
    parser.add_argument("--tp-batch", dest="batch", type=int, default=256, help=argparse.SUPPRESS)
    return parser.parse_args()


def _one_thread():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def _mlp(stages, width, unbuilt=False, per_stage=2):
    import keras

    from matex.parallel import StageBoundary

    keras.utils.set_random_seed(0)
    layers = [] if unbuilt else [keras.Input((width,))]
    for s in range(stages):
        if s:
            layers.append(StageBoundary(name="cut%d" % s))
        for i in range(per_stage):
            layers.append(keras.layers.Dense(width, activation="tanh", name="d%d_%d" % (s, i)))
    return keras.Sequential(layers)


def _time_steps(step, steps, barrier):
    step()
    step()   # traced and warm
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


# ---- workers ------------------------------------------------------------------

def worker_bubble(args):
    """Reference step on rank 0 alone, then a pipelined step for every M; rank 0 reports."""
    _one_thread()
    import keras
    import numpy as np

    import matex
    from matex.parallel import PipelineModel

    comm = matex.comm()
    P, width, batch = comm.Get_size(), args.width, 256
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    result = {"stages": P, "width": width, "batch": batch}
    if comm.Get_rank() == 0:
        ref = _mlp(P, width)
        ref.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
        result["reference_s"] = _time_steps(lambda: ref.train_on_batch(x, y), args.steps,
                                            lambda: None)
        result["stage_s"] = result["reference_s"] / P
    comm.Barrier()
    result["pipeline_s"] = {}
    for m in [int(v) for v in args.micro.split(",")]:
        pm = PipelineModel(_mlp(P, width), microbatches=m, schedule="1f1b")
        pm.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
        seconds = _time_steps(lambda: pm.train_on_batch(x, y), args.steps, comm.Barrier)
        result["pipeline_s"][str(m)] = max(comm.allgather(seconds))
    _common.emit(result, comm.Get_rank())


def _peak_kb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _rss_kb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def worker_memory(args):
    """Build and train the model as R pipeline stages or R data replicas; peak growth per rank."""
    _one_thread()
    import keras
    import numpy as np

    import matex
    from matex.parallel import PipelineModel

    comm = matex.comm()
    R, width, batch = comm.Get_size(), args.width, 64
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    # start TensorFlow, the ops and Keras's training machinery on a tiny model first
    warm = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    warm.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.Adam()), loss="mse")
    warm.train_on_batch(np.zeros((4, 4), "float32"), np.zeros((4, 4), "float32"))
    comm.Barrier()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")   # reset VmHWM to the current resident size
    start = _rss_kb()
    model = _mlp(R, width, unbuilt=True)
    whole = 4 * R * 2 * width * (width + 1)   # float32 bytes of every stage's two layers
    if args.mode == "pipeline":
        pm = PipelineModel(model, microbatches=4)
        pm.build((None, width))
        pm.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        for _ in range(3):
            pm.train_on_batch(x, y)
        held = pm.stage_bytes()
        grown = (_peak_kb() - start) * 1024
        # saving the whole model as one .keras file: rank 0 writes each stage's weights as
        # they arrive (never the whole model); each rank's peak growth during the save
        import tempfile
        with tempfile.TemporaryDirectory() as directory:
            path = comm.bcast(os.path.join(directory, "pipeline.keras"), root=0)
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            before = _rss_kb()
            pm.save(path)
            saved = (_peak_kb() - before) * 1024
            # the previous save, for comparison: gather the whole model on rank 0, then
            # keras.Model.save (what an extra save option, here zipped=True, still does)
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            before = _rss_kb()
            pm.save(path, zipped=True)
            gathered = (_peak_kb() - before) * 1024
        save_peaks = comm.allgather(saved)
        gathered_save_peaks = comm.allgather(gathered)
    else:
        model.build((None, width))
        model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.Adam(1e-4)),
                      loss="mse")
        n = batch // R
        r = comm.Get_rank()
        for _ in range(3):
            model.train_on_batch(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
        held = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
        save_peaks = gathered_save_peaks = None
        grown = (_peak_kb() - start) * 1024
    result = {"mode": args.mode, "ranks": R, "model_bytes": whole,
              "peak_growth_bytes": max(comm.allgather(grown)),
              "parameter_bytes_per_rank": max(comm.allgather(held)),
              "save_peak_bytes": save_peaks, "gathered_save_peak_bytes": gathered_save_peaks}
    _common.emit(result, comm.Get_rank())


# ---- driver -----------------------------------------------------------------------

def _mb(n):
    return "%.0f MB" % (n / 1e6)


def main():
    args = _parse()
    if args.worker == "bubble":
        return worker_bubble(args)
    if args.worker == "memory":
        return worker_memory(args)
    if args.worker == "tensor":
        return _mp_tensor.worker(args)
    script = os.path.abspath(__file__)
    sections = [args.only] if args.only else list(SECTIONS)
    results = {}
    command = "python benchmarks/model_parallel.py%s%s" % (
        " --quick" if args.quick else "", " --only " + args.only if args.only else "")
    print(_common.header("Model parallelism: pipeline bubble and memory per rank", command))
    with open("/proc/loadavg") as f:
        print("load average at start: %s\n" % " ".join(f.read().split()[:3]))
    if "tensor" in sections:
        _mp_tensor.section(script, args, results)
    if "pipeline" in sections:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count()   # the driver's: mpiexec binds each rank to one core
        stages = [2] if args.quick else [2, 4]
        micro = "1,4" if args.quick else "1,4,16"
        width = 512 if args.quick else 1024
        steps = 3 if args.quick else 6
        rows = []
        for P in stages:
            r = _common.run_phase(script, "bubble", P, ["--micro", micro, "--width", str(width),
                                                        "--steps", str(steps)])
            results["bubble_P%d" % P] = r
            for m, seconds in sorted(r["pipeline_s"].items(), key=lambda kv: int(kv[0])):
                m = int(m)
                rows.append([str(P), str(m), "%.1f" % (1e3 * r["reference_s"]),
                             "%.1f" % (1e3 * r["stage_s"]), "%.1f" % (1e3 * seconds),
                             "%.2f" % (seconds / r["stage_s"]), "%.2f" % ((m + P - 1) / m),
                             "%.1f" % max(1.0, P / cores)])
        print("### Pipeline bubble (1F1B, batch 256, %d-wide Dense, 2 per stage, 1 thread per "
              "rank)\n" % width)
        print(_common.table(["P", "M", "1-process step ms", "stage share ms (t1/P)",
                             "pipelined step ms", "measured / share", "ideal (M+P-1)/M",
                             "oversubscription"], rows))
        print()
    if "memory" in sections:
        ranks = 4   # 4 stages: 4 W / 4 + start-up overhead fits 2 W; 2 stages would not
        width = 2048
        rows, fits = [], {}
        for mode in ("pipeline", "data"):
            r = _common.run_phase(script, "memory", ranks, ["--mode", mode,
                                                            "--width", str(width)])
            results["memory_" + mode] = r
            cap = 3 * r["model_bytes"]
            fits[mode] = r["peak_growth_bytes"] <= cap
            rows.append([mode, str(ranks), _mb(r["model_bytes"]),
                         _mb(r["parameter_bytes_per_rank"]), _mb(r["peak_growth_bytes"]),
                         _mb(cap), "fits" if fits[mode] else "EXCEEDS",
                         "%.2f" % (r["peak_growth_bytes"] / r["model_bytes"])])
        print("### Memory per rank (Adam; %d ranks; cap = 3 x model bytes)\n" % ranks)
        print(_common.table(["layout", "ranks", "model", "parameters per rank",
                             "peak growth per rank", "cap", "under cap",
                             "peak / model"], rows))
        print()
        pipe = results["memory_pipeline"]
        print("Saving the pipeline as one .keras file (PipelineModel.save: rank 0 builds the "
              "whole model weightless and writes each weight into the file as it arrives): "
              "peak growth per rank %s MB for %s of weights (%s x the weights; one layer's "
              "kernel is %s); the previous save (the whole model gathered on rank 0, then "
              "keras.Model.save; still used for extra save options): %s MB.\n"
              % (" / ".join("%.1f" % (b / 1e6) for b in pipe["save_peak_bytes"]),
                 _mb(pipe["model_bytes"]),
                 " / ".join("%.2f" % (b / pipe["model_bytes"]) for b in pipe["save_peak_bytes"]),
                 _mb(4 * width * width),
                 " / ".join("%.1f" % (b / 1e6) for b in pipe["gathered_save_peak_bytes"])))
        print(_common.target("pipeline fits under the cap, data parallel does not",
                             fits["pipeline"] and not fits["data"],
                             "pipeline %s, data %s" % (fits["pipeline"], fits["data"])))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
