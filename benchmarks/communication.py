"""Communicating less: bytes, step time and accuracy of each option against dense, one run.

    python benchmarks/communication.py [--quick] [--network shm|tcp]

Rows: dense data parallelism, then each way of communicating less: FP16,
TopK(0.01) with error feedback, PowerSGD(4) (``matex.compression``, when
present), LocalSGD(H), DiLoCo(H) and ``delay=1``. Per row, on 2 ranks: bytes
this rank hands to MPI per step (``matex.stats()`` for the gradient paths;
for LocalSGD/DiLoCo the weights averaged every H steps divided by H; for
delay=1 the dense gradient), median step time, held-out accuracy after a
fixed number of samples, and the training time (steps only, evaluation
excluded) to a target accuracy; ratios against dense measured in the same
run. Model: an MLP of 11.0 M parameters (``--quick``: 0.09 M, a smoke run
whose figures mean nothing) on a synthetic 10-class problem (labels from a
random linear teacher).

``--network tcp`` forces Open MPI's TCP transport over loopback (no shared
memory). Shaping a link (1 or 10 Gbit/s between network namespaces) is not
done by this script: see README "Communicating less" for why.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

H = 8


def _options():
    names = ["dense", "fp16", "topk", "powersgd", "localsgd", "diloco", "delay"]
    try:
        import matex.compression  # noqa: F401
    except ImportError:   # part of the same issue; absent in older trees
        names = [n for n in names if n not in ("fp16", "topk", "powersgd")]
    return names


def _optimizer(name, keras, matex):
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "localsgd":
        return matex.LocalSGD(inner, sync_every=H)
    if name == "diloco":
        return matex.DiLoCo(inner, keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
                            sync_every=H)
    if name == "delay":
        return matex.DistributedOptimizer(inner, delay=1)
    compression = None
    if name != "dense":
        from matex.compression import FP16, PowerSGD, TopK

        compression = {"fp16": FP16, "topk": TopK(0.01, error_feedback=True),
                       "powersgd": PowerSGD(4)}[name]
    return matex.DistributedOptimizer(inner, compression=compression)


def worker(args):
    import keras
    import numpy as np
    import tensorflow as tf

    import matex

    rank, size = matex.rank(), matex.size()
    d, hidden, steps, per_rank = (64, 256, 20, 32) if args.quick else (512, 3072, 120, 64)
    target = 0.3 if args.quick else 0.6
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(d, 10))
    n = steps * per_rank * size
    x = rng.normal(size=(n + 2048, d)).astype("float32")
    y = np.argmax(x @ teacher, axis=1).astype("int64")
    xt, yt, x, y = x[n:], y[n:], x[:n], y[:n]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = {}
    for name in _options():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(10)])
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        opt = _optimizer(name, keras, matex)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        def accuracy():
            return float(np.mean(np.argmax(model.predict_on_batch(xt), 1) == yt))

        times, reached, trained = [], None, 0.0
        if hasattr(matex, "stats"):
            from matex import _stats

            _stats.reset()
        for t in range(steps):
            lo = (t * size + rank) * per_rank
            matex.comm().Barrier()
            start = time.perf_counter()
            step(x[lo:lo + per_rank], y[lo:lo + per_rank])
            if name == "delay" and t == steps - 1:
                matex.flush(opt)
            elapsed = time.perf_counter() - start
            if t >= 2:
                times.append(elapsed)
            if t >= 1:   # step 0 traces the step function: not training time
                trained += elapsed
            if reached is None and (t + 1) % 10 == 0 and accuracy() >= target:
                reached = trained
        dense_bytes = 4 * params
        if name in ("localsgd", "diloco"):
            sent = dense_bytes / H
        elif name == "delay":
            sent = dense_bytes
        else:
            sent = matex.stats()["bytes_sent_per_step"]
        results[name] = {"bytes_per_step": sent, "step_s": float(np.median(times)),
                         "accuracy": accuracy(), "seconds_to_target": reached,
                         "params": params, "samples": n, "target": target}
        if rank == 0:
            print("communication: %s done" % name, file=sys.stderr, flush=True)
    _common.emit(results, rank)


def _seconds(value):
    return "not reached" if value is None else "%.1f s" % value


def report(results, network):
    dense = results["dense"]
    rows = []
    for name, r in results.items():
        reach = r["seconds_to_target"]
        rows.append([name, "%.2f MB" % (r["bytes_per_step"] / 1e6),
                     "%.1fx" % (dense["bytes_per_step"] / max(r["bytes_per_step"], 1)),
                     "%.1f ms" % (1e3 * r["step_s"]), "%.2fx" % (dense["step_s"] / r["step_s"]),
                     "%.3f" % r["accuracy"],
                     _seconds(reach)])
    lines = ["network: %s (2 ranks); model %.1f M parameters; %d samples; target accuracy %.2f"
             % (network, dense["params"] / 1e6, dense["samples"], dense["target"]), "",
             _common.table(["option", "bytes/step", "less", "step", "speed-up", "accuracy",
                            "time to target"], rows), ""]
    for name in ("topk", "powersgd"):
        if name in results:
            r = results[name]
            faster = dense["step_s"] / r["step_s"]
            lines.append(_common.target(
                "%s: >= 3x faster steps than dense on this network" % name, faster >= 3,
                "%.2fx" % faster))
            ok = (r["seconds_to_target"] is not None and (dense["seconds_to_target"] is None
                  or r["seconds_to_target"] < dense["seconds_to_target"]))
            lines.append(_common.target("%s: reaches the target before dense" % name, ok,
                                        "%s vs %s" % (_seconds(r["seconds_to_target"]),
                                                      _seconds(dense["seconds_to_target"]))))
    return "\n".join(lines)


def main():
    argv = sys.argv[1:]
    network = "shm"
    if "--network" in argv:
        i = argv.index("--network")
        network = argv[i + 1]
        del sys.argv[1 + i:3 + i]
    if network not in ("shm", "tcp"):
        raise SystemExit("--network must be shm or tcp, not %r" % network)
    args = _common.parse_args(__doc__.splitlines()[0], ["worker"], repeats=1)
    if args.worker:
        return worker(args)
    mpi_args = ["--mca", "btl", "tcp,self"] if network == "tcp" else []
    phase = dict(nranks=2, args=["--quick"] if args.quick else [], mpi_args=mpi_args)
    results = _common.run_phases(__file__, {"worker": phase}, args.repeats)["worker"]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(_common.header("Communicating less", "python benchmarks/communication.py%s "
                         "--network %s" % (" --quick" if args.quick else "", network)))
    print("load average at the end: %s\n" % load)
    print(report(results, network))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
