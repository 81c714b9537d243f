"""Allreduce latency: matex.allreduce vs raw mpi4py vs MultiWorkerMirroredStrategy.

    python benchmarks/allreduce.py            # full run, 4 KB - 64 MB
    python benchmarks/allreduce.py --quick    # smoke run

Two ranks on this machine, float32 sum. Phase ``mpi`` (one mpiexec) measures,
interleaved round-robin per size: raw mpi4py ``Allreduce`` of NumPy arrays
into a preallocated buffer (the reference); the same as a copy followed by an
in-place ``Allreduce`` (what the fused path does); raw ``Allreduce`` followed
by the cheapest eager TensorFlow op (the floor for any eager op wrapping MPI);
``matex.allreduce`` called eagerly; and ``matex.allreduce`` inside a
``tf.function`` issuing N >= 8 of them per call (time / N; N makes a call last
~50 ms, so TensorFlow's fixed cost of a call is spread as over a training
step's collectives); the two matex ones also with the core's agreement check
disabled. Phase ``mwms`` (its own mpiexec: the strategy must exist before
other TensorFlow work) measures ring all-reduces inside a ``tf.function``
through ``strategy.run``: one per call, and N per call like the matex one (no
MPI barrier there: its busy-wait would slow the strategy's threads). Each
figure is the median over rounds of a batch's time per call, the worse of the
two ranks, then the median over ``--repeats`` runs.

Targets (from the issues): matex <= 1.10x raw MPI from 1 MB up, <= 1.05x at
16-64 MB in tf.function, <= +20 us at 4 KB, and >= 10x faster than
MultiWorkerMirroredStrategy up to 1 MB.
"""

import _common

FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]
UNROLLED = 8   # allreduces per tf.function call, at least


def unrolled_count(nbytes, quick):
    """Allreduces per tf.function call (8 to 100): enough for a call to last
    ~50 ms (10 ms quick) by the same estimate as ``calls_per_batch``, so
    TensorFlow's own cost of a call (~0.4 ms, cache-cold after large
    collectives) is spread as over a training step's many collectives."""
    return max(UNROLLED, calls_per_batch(nbytes, 20e-6, 2e9, 1e-2 if quick else 5e-2, 100))


def sizes(quick):
    """Message sizes in bytes."""
    return QUICK_SIZES if quick else FULL_SIZES


def batch_budget(quick):
    """Seconds one timed batch of matex or mpi4py calls should take."""
    return 2e-3 if quick else 5e-3


def calls_per_batch(nbytes, fixed, bandwidth, budget, most):
    """How many calls make one timed batch of about ``budget`` seconds."""
    estimate = fixed + nbytes / bandwidth
    return max(1, min(most, int(budget / estimate)))


def worker_mpi(args):
    """Raw mpi4py vs matex eager vs matex in tf.function, with and without agreement check."""
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import matex

    world = MPI.COMM_WORLD
    core = matex._runtime._core()
    rounds = 5 if args.quick else 41
    rows, calls_per_op, faults = {}, {}, {}
    for nbytes in sizes(args.quick):
        send = np.ones(nbytes // 4, np.float32)
        recv = np.empty_like(send)
        tensor = tf.constant(send)
        calls = calls_per_batch(nbytes, 20e-6, 2e9, batch_budget(args.quick), 100)
        unrolled_calls = unrolled_count(nbytes, args.quick)
        unrolled = _unrolled_allreduce(tf, matex, unrolled_calls)
        tiny = tf.constant(np.ones(16, np.float32))

        def mpi():
            world.Allreduce(send, recv, op=MPI.SUM)

        def mpi_copy_in_place():
            np.copyto(recv, send)
            world.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM)

        def mpi_then_tf_op():
            # the floor for any eager TensorFlow op wrapping MPI: the cheapest
            # op there is, on 16 floats, right after each raw Allreduce
            world.Allreduce(send, recv, op=MPI.SUM)
            tf.raw_ops.Identity(input=tiny)

        def eager():
            matex.allreduce(tensor, op="sum")

        def function():
            unrolled(tensor)

        def measured(check, fn, repeat, ops):
            def measure():
                core.set_agreement_check(check)
                return _common.per_call(fn, repeat, world.Barrier) / ops
            return measure

        function()  # trace outside the timing
        variants = {
            "mpi": measured(True, mpi, calls, 1),
            "mpi_copy_in_place": measured(True, mpi_copy_in_place, calls, 1),
            "mpi_then_tf_op": measured(True, mpi_then_tf_op, calls, 1),
            "eager": measured(True, eager, calls, 1),
            "function": measured(True, function, 1, unrolled_calls),
            "eager_nocheck": measured(False, eager, calls, 1),
            "function_nocheck": measured(False, function, 1, unrolled_calls),
        }
        rows[str(nbytes)] = {k: v * 1e6 for k, v in _common.interleave(variants, rounds).items()}
        calls_per_op[str(nbytes)] = _mpi_calls_per_op(core, eager, function, unrolled_calls)
        faults[str(nbytes)] = {"mpi": _faults_per_call(mpi, 4, world.Barrier),
                               "function": _faults_per_call(function, 1, world.Barrier)
                               / unrolled_calls}
    core.set_agreement_check(True)
    _common.emit(_common.worst_over_ranks(world, {"us": rows, "mpi_calls": calls_per_op,
                                                  "faults": faults}),
                 world.Get_rank())


def _unrolled_allreduce(tf, matex, count):
    """A tf.function running ``count`` matex allreduces of its argument, in program order."""
    @tf.function
    def unrolled(tensor):
        return [matex.allreduce(tensor, op="sum") for _ in range(count)][-1]
    return unrolled


def _mpi_calls_per_op(core, eager, function, calls):
    """MPI collective calls per allreduce, eager and in tf.function, check on and off."""
    counts = {}
    for check in (True, False):
        core.set_agreement_check(check)
        suffix = "" if check else "_nocheck"
        before = core.collective_call_count()
        eager()
        counts["eager" + suffix] = core.collective_call_count() - before
        before = core.collective_call_count()
        function()
        counts["function" + suffix] = (core.collective_call_count() - before) / calls
    return counts


def _faults_per_call(fn, calls, barrier):
    """Minor page faults of this process per call of ``fn`` (after one warm call).

    A fresh output buffer per allreduce that the kernel must map and zero would
    show here, as 4 KB pages per call.
    """
    import resource

    fn()
    barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def worker_mwms(args):
    """One ring all-reduce per strategy.run call of a tf.function."""
    strategy = _common.mwms_strategy()
    import tensorflow as tf
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rounds = 2 if args.quick else 7
    rows = {}
    for nbytes in sizes(args.quick):
        tensor = tf.ones([nbytes // 4])
        step = _mwms_allreduce(tf, strategy, tensor, 1)
        count = unrolled_count(nbytes, args.quick)
        unrolled = _mwms_allreduce(tf, strategy, tensor, count)
        step(), unrolled()  # trace and set up the collectives
        calls = calls_per_batch(nbytes, 1.5e-3, 1.5e8, 10 * batch_budget(args.quick), 20)
        # No MPI barrier: its busy-wait would compete with the strategy's gRPC threads.
        variants = {"mwms": lambda: _common.per_call(step, calls),
                    "mwms_function": lambda: _common.per_call(unrolled, 1) / count}
        rows[str(nbytes)] = {k: v * 1e6 for k, v in _common.interleave(variants, rounds).items()}
    _common.emit(_common.worst_over_ranks(world, {"us": rows}), world.Get_rank())


def _mwms_allreduce(tf, strategy, tensor, count):
    """A tf.function all-reducing ``tensor`` (sum) ``count`` times across the workers."""
    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            return [context.all_reduce("sum", tensor) for _ in range(count)][-1]
        return strategy.run(replica_fn)
    return step


def report(results, quick):
    """The table and target lines."""
    mpi, mwms = results["mpi"]["us"], results["mwms"]["us"]
    rows = []
    for nbytes in sizes(quick):
        us, ref, strategy = mpi[str(nbytes)], mpi[str(nbytes)]["mpi"], mwms[str(nbytes)]
        rows.append([
            _common.size_label(nbytes), "%.1f" % ref, "%.2f" % (us["mpi_copy_in_place"] / ref),
            "%.2f" % (us["mpi_then_tf_op"] / ref),
            "%.1f" % us["eager"], "%.2f" % (us["eager"] / ref),
            "%.1f" % us["function"], "%.2f" % (us["function"] / ref),
            "%.2f" % (us["eager_nocheck"] / ref), "%.2f" % (us["function_nocheck"] / ref),
            "%.1f" % strategy["mwms"], "%.1f" % (strategy["mwms"] / us["eager"]),
            "%.1f" % strategy["mwms_function"],
            "%.1f" % (strategy["mwms_function"] / us["function"]),
        ])
    headers = ["size", "mpi4py us", "mpi4py copy+in-place x mpi4py",
               "mpi4py + any TF eager op x mpi4py", "matex eager us", "x mpi4py",
               "matex tf.function us", "x mpi4py",
               "eager no-check x mpi4py", "tf.function no-check x mpi4py",
               "MWMS us", "MWMS / matex eager",
               "MWMS N per tf.function us", "that / matex tf.function"]
    lines = [_common.table(headers, rows), ""]
    calls = results["mpi"]["mpi_calls"][str(sizes(quick)[0])]
    lines.append("MPI calls per allreduce: %g with the agreement check, %g without "
                 "(eager); %g / %g (tf.function)."
                 % (calls["eager"], calls["eager_nocheck"], calls["function"],
                    calls["function_nocheck"]))
    faults = results["mpi"]["faults"]
    lines.append("Minor page faults per allreduce, most over ranks (mpi4py / matex in "
                 "tf.function; a fresh output in 4 KB pages would add size / 4 KB): " + "; ".join(
                     "%s %g / %g" % (_common.size_label(n), faults[str(n)]["mpi"],
                                     faults[str(n)]["function"])
                     for n in sizes(quick) if n >= 1 << 20) + ".")
    lines += ["", "Targets:"] + _targets(mpi, mwms, quick)
    return "\n".join(lines)


def _targets(mpi, mwms, quick):
    lines = []
    large = [n for n in sizes(quick) if n >= 1 << 20]
    for mode in ("eager", "function"):
        worst = max(large, key=lambda n: mpi[str(n)][mode] / mpi[str(n)]["mpi"])
        ratio = mpi[str(worst)][mode] / mpi[str(worst)]["mpi"]
        nocheck = mpi[str(worst)][mode + "_nocheck"] / mpi[str(worst)]["mpi"]
        floor = ("; raw Allreduce + any eager TF op: %.2fx there"
                 % (mpi[str(worst)]["mpi_then_tf_op"] / mpi[str(worst)]["mpi"])
                 if mode == "eager" else "")
        lines.append(_common.target(
            "matex %s <= 1.10x mpi4py from 1 MB up" % _label(mode), ratio <= 1.10,
            "worst %.2fx at %s; %.2fx without the agreement check%s"
            % (ratio, _common.size_label(worst), nocheck, floor)))
    # the bar for large tensors: N per tf.function call, so the call's
    # own cost (~0.4 ms) is spread over N >= 8 collectives of >= 6 ms each
    big = [n for n in sizes(quick) if n >= 16 << 20] or [max(sizes(quick))]
    worst = max(big, key=lambda n: mpi[str(n)]["function"] / mpi[str(n)]["mpi"])
    ratio = mpi[str(worst)]["function"] / mpi[str(worst)]["mpi"]
    lines.append(_common.target(
        "matex in tf.function <= 1.05x mpi4py at %s" % "-".join(
            _common.size_label(n) for n in sorted({min(big), max(big)})),
        ratio <= 1.05, "worst %.3fx at %s" % (ratio, _common.size_label(worst))))
    small = mpi[str(4 << 10)]
    for mode in ("eager", "function"):
        extra = small[mode] - small["mpi"]
        lines.append(_common.target(
            "matex %s <= mpi4py + 20 us at 4 KB" % _label(mode), extra <= 20,
            "+%.1f us; +%.1f us without the agreement check"
            % (extra, small[mode + "_nocheck"] - small["mpi"])))
    upto = [n for n in sizes(quick) if n <= 1 << 20]
    for mode, theirs, how in (("eager", "mwms", "one all-reduce per tf.function call"),
                              ("function", "mwms_function",
                               "both N per tf.function call")):
        worst = min(upto, key=lambda n: mwms[str(n)][theirs] / mpi[str(n)][mode])
        speedup = mwms[str(worst)][theirs] / mpi[str(worst)][mode]
        lines.append(_common.target(
            "matex %s >= 10x faster than MultiWorkerMirroredStrategy (%s) up to 1 MB"
            % (_label(mode), how), speedup >= 10,
            "smallest speed-up %.1fx at %s; raw mpi4py is %.1fx faster there"
            % (speedup, _common.size_label(worst),
               mwms[str(worst)][theirs] / mpi[str(worst)]["mpi"])))
    return lines


def _label(mode):
    return "eager" if mode == "eager" else "in tf.function"


def main():
    """Driver (no ``--worker``) or one worker phase."""
    args = _common.parse_args(__doc__.splitlines()[0], ["mpi", "mwms"], repeats=2)
    if args.worker == "mpi":
        return worker_mpi(args)
    if args.worker == "mwms":
        return worker_mwms(args)
    extra = ["--quick"] if args.quick else []
    phases = {"mpi": dict(nranks=2, args=extra), "mwms": dict(nranks=2, args=extra)}
    results = _common.run_phases(__file__, phases, args.repeats)
    command = "python benchmarks/allreduce.py" + (" --quick" if args.quick else "")
    print(_common.header("allreduce, 2 ranks, float32 sum", command))
    print(report(results, args.quick))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
