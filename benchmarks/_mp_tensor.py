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
parameter bytes each rank holds. Every rank uses one TensorFlow thread.
"""

import os
import statistics
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
    grid = None
    if args.mode == "tensor":
        grid = mp.grid(tensor=comm.Get_size())
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
              "cores": os.cpu_count()}
    rank = world.Get_rank()
    if grid is not None:
        grid.close()
    _common.emit(result, rank)


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
                     "%.2f" % (r["parameter_bytes"] / base["parameter_bytes"])])
    print("### Tensor parallel: 2-way Dense split vs replicated (2 ranks; Dense %d -> %d -> %d, "
          "global batch %d, 1 thread per rank, %d cores)\n"
          % (width, 4 * width, width, batch, base["cores"]))
    print(_common.table(["layout", "step ms", "time ratio", "MB to collectives per rank/step",
                         "bytes ratio", "parameter MB per rank", "parameter ratio"], rows))
    print()
    tp = runs["tensor"]
    expect = 4 * batch * width   # the forward allreduce of batch x width float32
    print("Expected tensor-parallel payload: one allreduce of %d x %d float32 = %.2f MB per step "
          "(the backward one, of the block's input gradient, is pruned: the input is data); "
          "replicated: the gradients, %.2f MB.\n"
          % (batch, width, expect / 1e6, base["parameter_bytes"] / 1e6))
    print(_common.target("each rank holds about half the parameters",
                         abs(tp["parameter_bytes"] / base["parameter_bytes"] - 0.5) < 0.01,
                         "%.3f" % (tp["parameter_bytes"] / base["parameter_bytes"])))
