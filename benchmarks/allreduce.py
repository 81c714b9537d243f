"""Allreduce latency: matex.allreduce vs raw mpi4py vs MultiWorkerMirroredStrategy.

    python benchmarks/allreduce.py            # full run, 4 KB - 64 MB
    python benchmarks/allreduce.py --quick    # smoke run

Two ranks on this machine, float32 sum. Phase ``mpi`` (one mpiexec) measures,
interleaved round-robin per size: raw mpi4py ``Allreduce`` of NumPy arrays
into a preallocated buffer (the reference), the same as a copy followed by an
in-place ``Allreduce`` (what the core does), ``matex.allreduce`` called eagerly,
and ``matex.allreduce`` inside a ``tf.function`` issuing N of them per call
(time / N), the two matex ones also with the core's agreement check disabled.
Phase ``mwms`` (its own mpiexec: the strategy must exist before other
TensorFlow work) measures one ring all-reduce per ``strategy.run`` call of a
``tf.function`` (no MPI barrier there: its busy-wait would slow the
strategy's threads). Each figure is the median over rounds of a batch's time
per call, the worse of the two ranks, then the median over ``--repeats`` runs.

Targets (from the issue): matex <= 1.10x raw MPI from 1 MB up, <= +20 us at
4 KB, and >= 10x faster than MultiWorkerMirroredStrategy up to 1 MB.
"""

import _common

FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]


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
    rows, calls_per_op = {}, {}
    for nbytes in sizes(args.quick):
        send = np.ones(nbytes // 4, np.float32)
        recv = np.empty_like(send)
        tensor = tf.constant(send)
        calls = calls_per_batch(nbytes, 20e-6, 2e9, batch_budget(args.quick), 100)
        unrolled = _unrolled_allreduce(tf, matex, calls)

        def mpi():
            world.Allreduce(send, recv, op=MPI.SUM)

        def mpi_copy_in_place():
            np.copyto(recv, send)
            world.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM)

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
            "eager": measured(True, eager, calls, 1),
            "function": measured(True, function, 1, calls),
            "eager_nocheck": measured(False, eager, calls, 1),
            "function_nocheck": measured(False, function, 1, calls),
        }
        rows[str(nbytes)] = {k: v * 1e6 for k, v in _common.interleave(variants, rounds).items()}
        calls_per_op[str(nbytes)] = _mpi_calls_per_op(core, eager, function, calls)
    core.set_agreement_check(True)
    _common.emit(_common.worst_over_ranks(world, {"us": rows, "mpi_calls": calls_per_op}),
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


def worker_mwms(args):
    """One ring all-reduce per strategy.run call of a tf.function."""
    strategy = _common.mwms_strategy()
    import tensorflow as tf
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rounds = 2 if args.quick else 7
    rows = {}
    for nbytes in sizes(args.quick):
        step = _mwms_allreduce(tf, strategy, tf.ones([nbytes // 4]))
        step()  # trace and set up the collective
        calls = calls_per_batch(nbytes, 1.5e-3, 1.5e8, 10 * batch_budget(args.quick), 20)
        # No MPI barrier: its busy-wait would compete with the strategy's gRPC threads.
        variants = {"mwms": lambda: _common.per_call(step, calls)}
        rows[str(nbytes)] = _common.interleave(variants, rounds)["mwms"] * 1e6
    _common.emit(_common.worst_over_ranks(world, {"us": rows}), world.Get_rank())


def _mwms_allreduce(tf, strategy, tensor):
    """A tf.function all-reducing ``tensor`` (sum) across the strategy's workers."""
    @tf.function
    def step():
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce("sum", tensor)
        return strategy.run(replica_fn)
    return step


def report(results, quick):
    """The table and target lines."""
    mpi, mwms = results["mpi"]["us"], results["mwms"]["us"]
    rows = []
    for nbytes in sizes(quick):
        us, ref = mpi[str(nbytes)], mpi[str(nbytes)]["mpi"]
        rows.append([
            _common.size_label(nbytes), "%.1f" % ref, "%.2f" % (us["mpi_copy_in_place"] / ref),
            "%.1f" % us["eager"], "%.2f" % (us["eager"] / ref),
            "%.1f" % us["function"], "%.2f" % (us["function"] / ref),
            "%.2f" % (us["eager_nocheck"] / ref), "%.2f" % (us["function_nocheck"] / ref),
            "%.1f" % mwms[str(nbytes)], "%.1f" % (mwms[str(nbytes)] / us["eager"]),
        ])
    headers = ["size", "mpi4py us", "mpi4py copy+in-place x mpi4py",
               "matex eager us", "x mpi4py", "matex tf.function us", "x mpi4py",
               "eager no-check x mpi4py", "tf.function no-check x mpi4py",
               "MWMS us", "MWMS / matex eager"]
    lines = [_common.table(headers, rows), ""]
    calls = results["mpi"]["mpi_calls"][str(sizes(quick)[0])]
    lines.append("MPI calls per allreduce: %g with the agreement check, %g without "
                 "(eager); %g / %g (tf.function)."
                 % (calls["eager"], calls["eager_nocheck"], calls["function"],
                    calls["function_nocheck"]))
    lines += ["", "Targets:"] + _targets(mpi, mwms, quick)
    return "\n".join(lines)


def _targets(mpi, mwms, quick):
    lines = []
    large = [n for n in sizes(quick) if n >= 1 << 20]
    for mode in ("eager", "function"):
        worst = max(large, key=lambda n: mpi[str(n)][mode] / mpi[str(n)]["mpi"])
        ratio = mpi[str(worst)][mode] / mpi[str(worst)]["mpi"]
        nocheck = mpi[str(worst)][mode + "_nocheck"] / mpi[str(worst)]["mpi"]
        lines.append(_common.target(
            "matex %s <= 1.10x mpi4py from 1 MB up" % _label(mode), ratio <= 1.10,
            "worst %.2fx at %s; %.2fx without the agreement check"
            % (ratio, _common.size_label(worst), nocheck)))
    small = mpi[str(4 << 10)]
    for mode in ("eager", "function"):
        extra = small[mode] - small["mpi"]
        lines.append(_common.target(
            "matex %s <= mpi4py + 20 us at 4 KB" % _label(mode), extra <= 20,
            "+%.1f us; +%.1f us without the agreement check"
            % (extra, small[mode + "_nocheck"] - small["mpi"])))
    upto = [n for n in sizes(quick) if n <= 1 << 20]
    worst = min(upto, key=lambda n: mwms[str(n)] / mpi[str(n)]["eager"])
    speedup = mwms[str(worst)] / mpi[str(worst)]["eager"]
    lines.append(_common.target(
        "matex eager >= 10x faster than MultiWorkerMirroredStrategy up to 1 MB", speedup >= 10,
        "smallest speed-up %.1fx at %s" % (speedup, _common.size_label(worst))))
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
