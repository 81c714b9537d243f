"""The tensor-parallel section of benchmarks/model_parallel.py (``--only tensor``).

A block of two large Dense layers (d -> 4d -> d, ReLU, MSE, SGD) trained on
2 ranks two ways, in the same run:

* **replicated**: the whole block on both ranks, data parallel
  (``DistributedOptimizer``), each rank on half of the global batch;
* **tensor**: ``ColumnParallelDense(4d, gather_output=False)`` +
  ``RowParallelDense(d)`` on ``grid(tensor=2)``: each rank holds half of the
  weights and runs the whole global batch (one allreduce of the activations
  forward, one backward).

Per step: the time (median of the timed steps, slowest rank) and the payload
bytes each rank hands to collectives of more than one rank (flight-recorder
entries: the gradient allreduce for replicated; for tensor the forward
activation allreduce; the backward one, of the block's input gradient, is
pruned by TensorFlow because the input is data), plus the
parameter bytes each rank holds, the peak resident growth per rank while the
model's weights are created (the slowest rank), and, for tensor, the peak
growth of ``gather_model`` on rank 0 and on the other rank, and of
``save_model`` on each rank (streamed into the file) against the previous save
(``gather_model``, then ``keras.Model.save`` on rank 0), as a ratio of the
plain model's weight bytes. Every rank uses one TensorFlow thread.
"""

import os
import statistics
import tempfile
import time

import _common


def worker(args):
    """Run one layout (``args.mode``: replicated | tensor) on 2 ranks; rank 0 reports."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import matex
    import matex.parallel as mp
    from matex import _native

    comm = matex.comm()
    d, batch = args.width, args.batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, d)).astype("float32")
    y = rng.normal(size=(batch, d)).astype("float32")
    init = keras.initializers.GlorotUniform(seed=0)
    grid = mp.grid(tensor=comm.Get_size()) if args.mode == "tensor" else None
    if grid is not None:
        mp.ColumnParallelDense(8, kernel_initializer=init).build((None, 8))   # load the ops
    keras.layers.Dense(8, kernel_initializer=init).build((None, 8))
    base = _reset_peak()
    if args.mode == "tensor":
        model = keras.Sequential([
            keras.Input((d,)),
            mp.ColumnParallelDense(4 * d, "relu", kernel_initializer=init, gather_output=False),
            mp.RowParallelDense(d, kernel_initializer=init)])
        xs, ys = x, y
    else:
        model = keras.Sequential([keras.Input((d,)),
                                  keras.layers.Dense(4 * d, "relu", kernel_initializer=init),
                                  keras.layers.Dense(d, kernel_initializer=init)])
        n, r = batch // comm.Get_size(), comm.Get_rank()
        xs, ys = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
    build_peak = _peak_growth(base)       # the weights' creation, before any step
    model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    for _ in range(2):
        model.train_on_batch(xs, ys)          # traced, first-step broadcast done
    core = _native.core()
    world = grid.world_comm if grid else comm
    world.Barrier()
    first = core.flight_sequence()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model.train_on_batch(xs, ys)
        times.append(time.perf_counter() - start)
    moved = sum(e["bytes"] for e in core.flight_entries()   # a 1-rank "collective" moves nothing
                if e["seq"] > first and e["comm_size"] > 1)
    result = {"mode": args.mode, "ranks": world.Get_size(), "width": d, "batch": batch,
              "step_s": max(world.allgather(statistics.median(times))),
              "bytes_per_step": max(world.allgather(moved / args.steps)),
              "parameter_bytes": max(world.allgather(mp.parameter_bytes(model))),
              "build_peak_bytes": max(world.allgather(build_peak)),
              "cores": os.cpu_count()}
    if grid is not None:
        # gathering the whole model to rank 0, streamed weight by weight: each rank's peak
        base = _reset_peak()
        whole = mp.gather_model(model, grid)
        peaks = world.allgather(_peak_growth(base))
        result["gather_peak_root_bytes"] = peaks[0]
        result["gather_peak_other_bytes"] = max(peaks[1:] or [0])
        if whole is not None:
            # the previous save_model: gather_model, then keras.Model.save on rank 0 (the
            # same base: the gather's growth included)
            with tempfile.TemporaryDirectory() as directory:
                whole.save(os.path.join(directory, "whole.keras"))
                result["whole_save_peak_bytes"] = _peak_growth(base)
        del whole
        # saving it as one .keras file, streamed into the file (rank 0 never holds the model)
        with tempfile.TemporaryDirectory() as directory:
            path = world.bcast(os.path.join(directory, "tp.keras"), root=0)
            base = _reset_peak()
            mp.save_model(model, path, grid)
            peaks = world.allgather(_peak_growth(base))
        result["save_peak_bytes"] = peaks
        result["model_bytes"] = 4 * (d * 4 * d + 4 * d + 4 * d * d + d)   # the plain model
    rank = world.Get_rank()
    if grid is not None:
        grid.close()
    _common.emit(result, rank)


def _memory_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def _reset_peak():
    """Reset this process's peak resident size (VmHWM) to now; returns the resident KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _memory_kib("VmRSS:")


def _peak_growth(base):
    """Bytes the peak resident size grew above ``base`` (KiB, from ``_reset_peak``)."""
    return (_memory_kib("VmHWM:") - base) * 1024


def section(script, args, results):
    """Run both layouts, print the table; results go into ``results``."""
    width = 256 if args.quick else 1024
    batch = 64 if args.quick else 256
    steps = 3 if args.quick else 10
    rows, runs = [], {}
    for mode in ("replicated", "tensor"):
        r = _common.run_phase(script, "tensor", 2, ["--mode", mode, "--width", str(width),
                                                    "--tp-batch", str(batch),
                                                    "--steps", str(steps)])
        runs[mode] = results["tensor_" + mode] = r
    base = runs["replicated"]
    for mode in ("replicated", "tensor"):
        r = runs[mode]
        rows.append([mode, "%.1f" % (1e3 * r["step_s"]), "%.2f" % (r["step_s"] / base["step_s"]),
                     "%.2f" % (r["bytes_per_step"] / 1e6),
                     "%.2f" % (r["bytes_per_step"] / base["bytes_per_step"]),
                     "%.2f" % (r["parameter_bytes"] / 1e6),
                     "%.2f" % (r["parameter_bytes"] / base["parameter_bytes"]),
                     "%.1f" % (r["build_peak_bytes"] / 1e6)])
    print("### Tensor parallel: 2-way Dense split vs replicated (2 ranks; Dense %d -> %d -> %d, "
          "global batch %d, 1 thread per rank, %d cores)\n"
          % (width, 4 * width, width, batch, base["cores"]))
    print(_common.table(["layout", "step ms", "time ratio", "MB to collectives per rank/step",
                         "bytes ratio", "parameter MB per rank", "parameter ratio",
                         "build peak MB per rank"], rows))
    print()
    tp = runs["tensor"]
    print("Gathering the tensor-parallel model to rank 0 (mp.gather_model, streamed weight by "
          "weight): peak growth %.1f MB on rank 0 (it builds the whole plain model, %.1f MB), "
          "%.1f MB on the other rank.\n"
          % (tp["gather_peak_root_bytes"] / 1e6, 2 * tp["parameter_bytes"] / 1e6,
             tp["gather_peak_other_bytes"] / 1e6))
    saved = tp["save_peak_bytes"]
    print("Saving it as one .keras file (mp.save_model: rank 0 builds the plain model "
          "weightless and writes each shard into the file as it arrives): peak growth per "
          "rank %s MB for %.1f MB of weights (%s x the weights); keras.Model.save of the "
          "gathered model on rank 0 (the previous save: gather_model, then Model.save): "
          "%.1f MB (%.2f x)."
          "\n" % (" / ".join("%.1f" % (b / 1e6) for b in saved), tp["model_bytes"] / 1e6,
                  " / ".join("%.2f" % (b / tp["model_bytes"]) for b in saved),
                  tp["whole_save_peak_bytes"] / 1e6,
                  tp["whole_save_peak_bytes"] / tp["model_bytes"]))
    expect = 4 * batch * width   # the forward allreduce of batch x width float32
    print("Expected tensor-parallel payload: one allreduce of %d x %d float32 = %.2f MB per step "
          "(the backward one, of the block's input gradient, is pruned: the input is data); "
          "replicated: the gradients, %.2f MB.\n"
          % (batch, width, expect / 1e6, base["parameter_bytes"] / 1e6))
    print(_common.target("each rank holds about half the parameters",
                         abs(tp["parameter_bytes"] / base["parameter_bytes"] - 0.5) < 0.01,
                         "%.3f" % (tp["parameter_bytes"] / base["parameter_bytes"])))
