"""Timeline overhead: the training step of benchmarks/training_step.py with the timeline on vs off.

    python benchmarks/timeline_overhead.py            # full run
    python benchmarks/timeline_overhead.py --quick    # smoke run

Two ranks, the small CNN of training_step.py trained by ``fit`` with
``matex.DistributedOptimizer`` (global batch 128, jit_compile=False). In one
run, interleaved rounds train with the timeline off, and on
(``matex.timeline.start``/``stop`` around the round, outside the timing;
every step recorded to a local temporary directory, with its step callback;
the writer thread reads the flight recorder every 2 s). The flight recorder itself is on in both
(its default). A round is one ``fit`` timed from the end of its first step to
the end of its last; figures are medians over rounds, the worse of the two
ranks. The writer thread's own CPU time per step (measured by the thread) is
reported too: on a machine shared with other jobs it separates what the timeline
costs from the noise in the step times.

Target: the timeline costs <= 2 % of the step while recording (Horovod's
timeline: up to 100x); off, the code path is the one without MaTEx's
timeline (no callback, no thread), so its cost is 0 by construction.
"""

import json
import os
import tempfile

import _common
import training_step

VARIANTS = {"off": "timeline off", "on": "timeline on (every step)"}


def worker(args):
    """Time fit with the timeline off and on, alternately."""
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    import matex
    import matex.keras  # noqa: F401 - fit as under matexrun (adds the timeline's step callback)
    from matex import timeline

    world = MPI.COMM_WORLD
    steps, measurements = training_step.settings(args.quick)
    data = training_step.dataset(tf, matex.rank(), matex.size(),
                                 training_step.GLOBAL_BATCH // matex.size())
    model = training_step.build_model(keras)
    training_step.compile_model(keras, model, matex.DistributedOptimizer(
        keras.optimizers.SGD(0.01)), jit_compile=False)
    fit = training_step.fit_measure(keras, model, data, steps)
    root = tempfile.mkdtemp(prefix="matex-timeline-bench-")
    rounds = {"n": 0, "events": 0, "cpu_ms_per_step": 0.0}

    def on():
        rounds["n"] += 1
        directory = os.path.join(root, "r%d" % rounds["n"])
        timeline.start(directory)
        try:
            return fit()
        finally:
            timeline.stop()
            path = os.path.join(directory, timeline.filename(matex.rank()))
            with open(path) as f:
                events = json.load(f)
            rounds["events"] = len(events)
            rounds["cpu_ms_per_step"] = events[-1]["args"]["writer_cpu_s"] * 1e3 / steps

    seconds = _common.interleave({"off": fit, "on": on}, measurements)
    result = {"ms_per_step": {k: v * 1e3 for k, v in seconds.items()},
              "events_per_file": rounds["events"],
              "writer_cpu_ms_per_step": rounds["cpu_ms_per_step"]}
    _common.emit(_common.worst_over_ranks(world, result), world.Get_rank())


def report(results):
    """The table and the target line."""
    ms = results["worker"]["ms_per_step"]
    rows = [[description, "%.3f" % ms[name]] for name, description in VARIANTS.items()]
    ratio = ms["on"] / ms["off"]
    lines = [_common.table(["variant", "ms/step"], rows), "",
             "One timeline file: %d events for %d steps; the writer thread's CPU time: "
             "%.3f ms per step (%.2f %% of the step)."
             % (results["worker"]["events_per_file"], results["steps"],
                results["worker"]["writer_cpu_ms_per_step"],
                100 * results["worker"]["writer_cpu_ms_per_step"] / ms["off"]),
             "", "Targets:",
             _common.target("timeline on <= 1.02x off", ratio <= 1.02,
                            "%.3fx (%+.3f ms/step)" % (ratio, ms["on"] - ms["off"]))]
    return "\n".join(lines)


def main():
    """Driver (no ``--worker``) or the worker phase."""
    _common.single_phase_main(
        __file__, __doc__.splitlines()[0], worker, report,
        "timeline overhead: fit of a small CNN, global batch %d, 2 ranks"
        % training_step.GLOBAL_BATCH,
        extra=lambda args: {"steps": training_step.settings(args.quick)[0]})


if __name__ == "__main__":
    main()
