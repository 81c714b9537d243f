"""Communicating less: bytes, step time and accuracy of each option against dense, one run.

    python benchmarks/communication.py [--quick] [--network shm|tcp|netns]
        [--rate 1gbit,10gbit] [--ranks N] [--steps N]

Rows: dense data parallelism, then each way of communicating less: FP16,
TopK(0.01) with error feedback, PowerSGD(4) (``matex.compression``, when
present), LocalSGD(H), DiLoCo(H) and ``delay=1``, and "nocomm" (each rank
alone, no MPI: the compute floor). Per row: bytes this rank hands to MPI per
step (``matex.stats()`` for the gradient paths; for LocalSGD/DiLoCo the
weights averaged every H steps divided by H; for delay=1 the dense
gradient), median and mean step time, held-out accuracy after a fixed
number of samples, and the training time (steps only, evaluation excluded)
to a target accuracy (90 % of dense's final accuracy, rounded down to
0.05); ratios against dense measured in the same run. Model: an MLP of
10.3 M parameters (``--quick``: 0.09 M, a smoke run whose figures mean
nothing) on a synthetic 10-class problem (labels from a random linear
teacher).

``--network tcp`` forces Open MPI's TCP transport over loopback (no shared
memory). ``--network netns`` (root, iproute2, tc) puts each rank in its own
network namespace "host" (tests/netns: a bridge, one veth per host, mpiexec
reaching the hosts through a launcher agent) and runs the whole job once per
``--rate`` (default 1gbit,10gbit): both directions of every host's link are
shaped by a token bucket (``tc qdisc ... tbf``) at that rate; MPI uses TCP
only (``btl tcp,self``, pinned to the hosts' eth0). No added latency: the
kernel needs netem for that, and this one may not have it (the output says
which). Each job first measures what an MPI point-to-point exchange achieves
on the link, so the table shows the shaping that was in force. ``--ranks``
(2-4) sets the rank count, ``--steps`` the training steps per option.
"""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

H = 8


def _options():
    names = ["dense", "fp16", "topk", "powersgd", "localsgd", "diloco", "delay", "nocomm"]
    try:
        import matex.compression  # noqa: F401
    except ImportError:   # part of the same issue; absent in older trees
        names = [n for n in names if n not in ("fp16", "topk", "powersgd")]
    return names


def _optimizer(name, keras, matex):
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "nocomm":     # each rank alone: the compute floor of a step
        return inner
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
    d, hidden, steps, per_rank = (64, 256, 20, 32) if args.quick else (256, 3072, 120, 64)
    steps = args.steps or steps
    link = _link_gbit(matex.comm(), 1 << 20 if args.quick else 8 << 20)
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

        times, curve, trained = [], [], 0.0
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
            if (t + 1) % 10 == 0 or t == steps - 1:   # evaluation is not training time
                curve.append([t + 1, trained, accuracy()])
        dense_bytes = 4 * params
        if name in ("localsgd", "diloco"):
            sent = dense_bytes / H
        elif name == "delay":
            sent = dense_bytes
        else:   # nocomm too: it must count nothing
            sent = matex.stats()["bytes_sent_per_step"]
        results[name] = {"bytes_per_step": sent, "step_s": float(np.median(times)),
                         "mean_step_s": trained / (steps - 1), "accuracy": curve[-1][2],
                         "curve": curve, "params": params, "samples": n, "ranks": size,
                         "link_gbit": link}
        if rank == 0:
            print("communication: %s done" % name, file=sys.stderr, flush=True)
    # the target: 90 % of dense's final accuracy, rounded down to 0.05 (dense reaches it;
    # a fixed figure would be unreachable or trivial depending on the samples run)
    target = max(0.05, int(0.9 * results["dense"]["accuracy"] / 0.05) * 0.05)
    for r in results.values():
        r["target"] = target
        r["seconds_to_target"] = next((sec for _, sec, acc in r["curve"] if acc >= target),
                                      None)
    _common.emit(results, rank)


def _link_gbit(comm, nbytes):
    """Gbit/s one direction of an MPI exchange between ranks 0 and 1 achieves (median of 5)."""
    import numpy as np
    from mpi4py import MPI

    rank = comm.Get_rank()
    send = np.ones(nbytes, np.uint8)
    recv = np.empty_like(send)
    times = []
    for _ in range(6):
        comm.Barrier()
        start = time.perf_counter()
        if rank in (0, 1):
            comm.Sendrecv(send, 1 - rank, 7, recv, 1 - rank, 7)
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        times.append(elapsed)
    return 8 * nbytes / float(np.median(times[1:])) / 1e9


def _seconds(value):
    return "not reached" if value is None else "%.1f s" % value


def report(results, network):
    """The table, the link the job measured, and whether each target is met."""
    dense = results["dense"]
    rows = []
    for name, r in results.items():
        reach = r["seconds_to_target"]
        rows.append([name, "%.2f MB" % (r["bytes_per_step"] / 1e6),
                     "%.1fx" % (dense["bytes_per_step"] / r["bytes_per_step"])
                     if r["bytes_per_step"] else "-",
                     "%.1f ms" % (1e3 * r["step_s"]), "%.2fx" % (dense["step_s"] / r["step_s"]),
                     "%.1f ms" % (1e3 * r["mean_step_s"]), "%.3f" % r["accuracy"],
                     _seconds(reach)])
    lines = ["network: %s (%d ranks); measured MPI point-to-point %.2f Gbit/s per direction"
             % (network, dense["ranks"], dense["link_gbit"]),
             "model %.1f M parameters; %d samples; target accuracy %.2f (90 %% of dense's "
             "final, rounded down to 0.05)" % (dense["params"] / 1e6, dense["samples"],
                                               dense["target"]),
             "step: median step time (speed-up: dense's median / this one's); mean: all steps "
             "but the first, syncs included; nocomm: no communication at all (compute floor)",
             "", _common.table(["option", "bytes/step", "less", "step", "speed-up", "mean",
                                "accuracy", "time to target"], rows), ""]
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


def _pop_option(argv, name, default):
    """Remove ``name VALUE`` from ``argv``; return VALUE (``default`` when absent)."""
    if name not in argv:
        return default
    i = argv.index(name)
    if i + 1 >= len(argv):
        raise SystemExit("%s needs a value" % name)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def _tc_rate(text):
    """'1gbit' -> bits per second (tc's units: kbit, mbit, gbit)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            try:
                return float(text[:-len(unit)]) * scale
            except ValueError:
                break
    raise SystemExit("--rate: %r is not a tc rate such as 1gbit or 500mbit" % text)


def _netem_available():
    """Whether this kernel accepts a netem qdisc (tried in a throwaway namespace)."""
    ns = "mtxprobe%d" % os.getpid()
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        return False
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], capture_output=True)
        proc = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True, text=True)
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _shape(cluster, rate):
    """Token-bucket every host's link at ``rate`` both ways; return the qdisc's parameters."""
    bits = _tc_rate(rate)
    burst = max(int(bits / 8 / 1000), 32 * 1024)     # 1 ms at the rate, at least 32 KB
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "10ms"]
    for i, host in enumerate(cluster.hosts):
        # host -> switch on the host's eth0, switch -> host on the switch's port
        for ns, dev in ((host, "eth0"), (cluster.prefix + "-sw", "p%d" % i)):
            cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"] + tbf
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit("shaping failed: %s: %s" % (" ".join(cmd), proc.stderr.strip()))
    return " ".join(tbf)


def run_in_namespaces(args, rate, nranks):
    """The worker phase on ``nranks`` namespace hosts whose links are shaped at ``rate``."""
    from matex import launcher

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tests", "netns"))
    import nscluster

    reason = nscluster.available()
    if reason:
        raise SystemExit("--network netns: %s" % reason)
    worker_args = (["--quick"] if args.quick else []) + (
        ["--steps", str(args.steps)] if args.steps else [])
    program = [sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--worker",
               "worker"] + worker_args
    with nscluster.Cluster(nranks) as cluster:      # removed again on any exit
        shaping = _shape(cluster, rate)
        mpiexec = launcher.find_mpiexec()
        env = cluster.env()
        mpi_args = launcher.cluster_mpi_args(
            mpiexec, hostfile=cluster.hostfile(1), launch_agent=str(nscluster.AGENT_SH),
            tcp_if="eth0", env=env) + ["--mca", "btl", "tcp,self"]
        cmd = launcher.mpiexec_command(nranks, program, mpi_args=mpi_args, mpiexec=mpiexec,
                                       oversubscribe=False)
        proc = cluster.run(cmd, timeout=3600)
        found = [line[len(_common.RESULT_MARK):] for line in proc.stdout.splitlines()
                 if line.startswith(_common.RESULT_MARK)]
        if proc.returncode != 0 or len(found) != 1:
            raise SystemExit("benchmark in namespaces failed (exit %d): %s\n%s\n%s\n%s"
                             % (proc.returncode, " ".join(cmd), proc.stdout[-4000:],
                                proc.stderr[-6000:], cluster.diagnostics()))
    import json

    return json.loads(found[0]), shaping


def main():
    argv = sys.argv[1:]
    network = _pop_option(argv, "--network", "shm")
    rates = _pop_option(argv, "--rate", "1gbit,10gbit").split(",")
    nranks = int(_pop_option(argv, "--ranks", "2"))
    steps = int(_pop_option(argv, "--steps", "0"))
    sys.argv[1:] = argv
    if network not in ("shm", "tcp", "netns"):
        raise SystemExit("--network must be shm, tcp or netns, not %r" % network)
    if not 2 <= nranks <= 4:
        raise SystemExit("--ranks must be 2, 3 or 4, not %d" % nranks)
    if steps < 0:
        raise SystemExit("--steps must be positive")
    for rate in rates:
        _tc_rate(rate)
    args = _common.parse_args(__doc__.splitlines()[0], ["worker"], repeats=1)
    args.steps = steps
    if args.worker:
        return worker(args)
    extra = ("" if nranks == 2 else " --ranks %d" % nranks) + (
        " --steps %d" % steps if steps else "")
    if network != "netns":
        mpi_args = ["--mca", "btl", "tcp,self"] if network == "tcp" else []
        worker_args = (["--quick"] if args.quick else []) + (
            ["--steps", str(steps)] if steps else [])
        phase = dict(nranks=nranks, args=worker_args, mpi_args=mpi_args)
        runs = {network: (_common.run_phases(__file__, {"worker": phase},
                                             args.repeats)["worker"], None)}
    else:
        runs = {"netns %s" % rate: run_in_namespaces(args, rate, nranks) for rate in rates}
        extra += " --rate %s" % ",".join(rates)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(_common.header("Communicating less", "python benchmarks/communication.py%s "
                         "--network %s%s" % (" --quick" if args.quick else "", network, extra)))
    print("load average (1, 5, 15 min) at the end: %s\n" % load)
    if network == "netns":
        print("shaping: each host's link, both directions, a token bucket (tc qdisc ... root "
              "<as below>); no added delay: netem is %s on this kernel\n"
              % ("available but not used" if _netem_available() else "unavailable"))
    for label, (results, shaping) in runs.items():
        if shaping:
            print("shaping in force: %s" % shaping)
        print(report(results, label))
        print()
    _common.write_json(args.json, {label: r for label, (r, _) in runs.items()}
                       if network == "netns" else runs[network][0])


if __name__ == "__main__":
    main()
