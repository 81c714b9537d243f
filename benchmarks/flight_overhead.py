"""Flight recorder overhead: the training step with the recorder on vs off, in one run.

    python benchmarks/flight_overhead.py            # full run
    python benchmarks/flight_overhead.py --quick    # smoke run

Two ranks, the step of benchmarks/small_tensors.py (a tf.function over 200
variables of 256 floats, gradients averaged with DistributedGradientTape):
fused (one collective per step) and unfused (200 collectives per step: the
worst case for a per-collective cost). The recorder is switched at run time
(capacity 1024 vs 0) between interleaved rounds, so both figures come from the
same processes; each figure is the median ms/step, the worse of the two ranks.
The stall inspector's watchdog runs in both (it wakes once a second).

Target: recording costs <= 2 % of the step (Horovod's timeline: up to 100x).
"""

import _common
import small_tensors

CAPACITY = 1024
VARIANTS = {
    # name: (description, fusion threshold, recorder capacity)
    "fused_off": ("fused, recorder off", "default", 0),
    "fused_on": ("fused, recorder on", "default", CAPACITY),
    "unfused_off": ("unfused (200 collectives), recorder off", 0, 0),
    "unfused_on": ("unfused (200 collectives), recorder on", 0, CAPACITY),
}


def worker(args):
    """Time every variant's step."""
    import tensorflow as tf
    from mpi4py import MPI

    import matex

    world = MPI.COMM_WORLD
    core = matex._runtime._core()
    variables = [tf.Variable(tf.fill([small_tensors.VARIABLE_SIZE], 0.01 * (i + 1)))
                 for i in range(small_tensors.NUM_VARIABLES)]
    x = tf.random.stateless_normal([small_tensors.VARIABLE_SIZE], seed=[1, 2])
    rounds = 5 if args.quick else 25
    calls = 5 if args.quick else 20
    steps, measures = {}, {}
    for name, (_, threshold, capacity) in VARIANTS.items():
        key = name.rsplit("_", 1)[0]
        if key not in steps:
            steps[key] = small_tensors._make_step(tf, matex, variables, x, threshold)
            steps[key]()  # trace outside the timing
        measures[name] = _measure(core, steps[key], capacity, calls, world.Barrier)
    ms = {k: v * 1e3 for k, v in _common.interleave(measures, rounds).items()}
    recorded = len(core.flight_entries())
    core.set_flight_capacity(CAPACITY)
    _common.emit(_common.worst_over_ranks(world, {"ms_per_step": ms, "recorded": recorded}),
                 world.Get_rank())


def _measure(core, step, capacity, calls, barrier):
    def measure():
        core.set_flight_capacity(capacity)
        return _common.per_call(step, calls, barrier)
    return measure


def report(results):
    """The table and the target line."""
    ms = results["worker"]["ms_per_step"]
    rows = [[description, "%.3f" % ms[name]] for name, (description, _, _) in VARIANTS.items()]
    lines = [_common.table(["variant", "ms/step"], rows), "", "Targets:"]
    for kind in ("fused", "unfused"):
        ratio = ms[kind + "_on"] / ms[kind + "_off"]
        lines.append(_common.target("%s: recorder on <= 1.02x off" % kind, ratio <= 1.02,
                                    "%.3fx (%+.3f ms/step)"
                                    % (ratio, ms[kind + "_on"] - ms[kind + "_off"])))
    return "\n".join(lines)


def main():
    """Driver (no ``--worker``) or the worker phase."""
    _common.single_phase_main(__file__, __doc__.splitlines()[0], worker, report,
                              "flight recorder overhead: %d variables of %d float32, 2 ranks"
                              % (small_tensors.NUM_VARIABLES, small_tensors.VARIABLE_SIZE))


if __name__ == "__main__":
    main()
