"""Loss-surface points per second: matex.science's dynamic hand-out vs a static split.

Two schemes on the same model, data and grid, each rank count one job
(TensorFlow starts once; both schemes run in it, one after the other):

* ``dynamic``: ``matex.science.loss_surface(ranks_per_point=1)``: rank 0
  serves a queue of grid points, every rank asks for the next one when done;
* ``static``: the scheme of tomgoldstein/loss-landscape's ``--mpi`` mode,
  written here as the baseline: the points are split into contiguous equal
  blocks up front, every rank evaluates its block over all the data, and after
  every point all ranks reduce the whole surface (max over a -1-filled array),
  ranks with fewer points joining with no new value.

Figures: points per second (grid points over the wall time of the computation,
after one warm-up point traced the functions), speed-up over one rank's
dynamic run, dynamic over static at the same rank count.

    python benchmarks/loss_surface.py            # 1, 2 and 4 ranks, 12x12 grid
    python benchmarks/loss_surface.py --quick    # 1 and 2 ranks, 5x5 grid
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

ROWS, FEATURES, CLASSES = 4000, 32, 10


def _model_and_data():
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, CLASSES))).argmax(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    return model, (x, y)


def _static(model, data, resolution, span):
    """loss-landscape's --mpi scheme: static blocks, the whole surface reduced after every point."""
    import numpy as np
    from mpi4py import MPI

    from matex import _runtime
    from matex.science import _data, _directions, _objective
    from matex.science._surface import surface_axes

    comm = _runtime.comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    self_comm = MPI.COMM_SELF.Dup()
    slot = _runtime.register_comm(self_comm)
    objective = _objective.Objective(model, _data.Share(data, 0, 1, 256), comm=slot)
    weights = objective.get()
    d1, d2 = _directions.random_directions(weights, 0)
    xs, ys = surface_axes(resolution, span)
    losses = -np.ones(resolution)
    mine = np.array_split(np.arange(losses.size), size)[rank]
    rounds = max(len(block) for block in np.array_split(np.arange(losses.size), size))
    for step in range(rounds):
        if step < len(mine):
            i, j = np.unravel_index(mine[step], resolution)
            objective.set([w + xs[i] * a + ys[j] * b for w, a, b in zip(weights, d1, d2)])
            losses[i, j] = objective.loss()
        total = np.empty_like(losses)
        comm.Allreduce(losses, total, op=MPI.MAX)
        losses = total
    objective.set(weights)
    _runtime.release_comm(slot)
    self_comm.Free()
    return losses


def worker(args):
    import numpy as np

    import matex
    import matex.science as science

    resolution = (5, 5) if args.quick else (12, 12)
    model, data = _model_and_data()
    comm = matex.comm()
    # warm-up: trace the loss function (one point, both schemes' code paths)
    science.loss_surface(model, data, resolution=(2, 2), max_points=1, verbose=0)
    result = {"ranks": comm.Get_size(), "points": resolution[0] * resolution[1]}
    surfaces = {}
    for scheme in ("dynamic", "static"):
        comm.Barrier()
        start = time.perf_counter()
        if scheme == "dynamic":
            surfaces[scheme] = science.loss_surface(model, data, resolution=resolution,
                                                    span=0.5, verbose=0)
        else:
            surfaces[scheme] = _static(model, data, resolution, 0.5)
        comm.Barrier()
        result[scheme] = result["points"] / (time.perf_counter() - start)
    result["max_difference"] = float(np.max(np.abs(surfaces["dynamic"] - surfaces["static"])))
    _common.emit(result, comm.Get_rank())


def main():
    args = _common.parse_args(__doc__.splitlines()[0], ["both"], repeats=1)
    if args.worker:
        return worker(args)
    counts = (1, 2) if args.quick else (1, 2, 4)
    extra = ["--quick"] if args.quick else []
    results = {}
    for n in counts:
        runs = [_common.run_phase(__file__, "both", n, args=extra) for _ in range(args.repeats)]
        results[str(n)] = _common.median_merge(runs)
    base = results["1"]["dynamic"]
    rows = []
    for n in counts:
        r = results[str(n)]
        for scheme in ("dynamic", "static"):
            rows.append([str(n), scheme, "%.2f" % r[scheme], "%.2f" % (r[scheme] / base),
                         "%.2f" % (r["dynamic"] / r[scheme])])
    print(_common.header("Loss surface: points per second", "python benchmarks/loss_surface.py"
                         + (" --quick" if args.quick else "")))
    print("%d-point grid, MLP %d-64-64-%d on %d rows; load average %s" % (
        results["1"]["points"], FEATURES, CLASSES, ROWS, open("/proc/loadavg").read().split()[0]))
    print()
    print(_common.table(["ranks", "scheme", "points/s", "vs 1 rank dynamic",
                         "dynamic / this"], rows))
    print()
    top = str(counts[-1])
    print(_common.target("dynamic at least as fast as the static split at %s ranks" % top,
                         results[top]["dynamic"] >= results[top]["static"],
                         "%.2f vs %.2f points/s" % (results[top]["dynamic"],
                                                   results[top]["static"])))
    worst = max(r["max_difference"] for r in results.values())
    print(_common.target("both schemes give the same surface", worst < 1e-5,
                         "largest difference %.2g" % worst))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
