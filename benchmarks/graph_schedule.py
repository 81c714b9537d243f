"""Cost of the TF1 graph-collective scheduler per Session.run, in one run.

    python benchmarks/graph_schedule.py            # full run
    python benchmarks/graph_schedule.py --quick    # smoke run

Two ranks, one TF1 graph: an MLP of 8 dense layers (64x64 weights and biases:
16 variables), a fed batch of 32 rows, v1 GradientDescent. The same
``Session`` runs, interleaved:

- ``plain``: the local step (no collective): what TensorFlow alone costs;
- ``unscheduled``: the step with the gradients averaged by one grouped
  allreduce, the scheduler's hook removed (one collective needs no order);
- ``scheduled``: the same step through the scheduler (plan lookup, the
  agreement on the run's collectives, the turnstile);
- ``scheduled_16``: the step with one allreduce per gradient (16), scheduled;
- ``hook_alone``: the scheduler's own work for the grouped step with the run
  itself left out (plan lookup, the agreement's allreduce, the turnstile's
  begin and end).

Each figure is the median ms/step, the worse of the two ranks. The
scheduler's cost is ``scheduled - unscheduled``.
"""

import _common

LAYERS, WIDTH, ROWS = 8, 64, 32
VARIANTS = {
    "plain": "local step, no collective (TensorFlow alone)",
    "unscheduled": "1 grouped allreduce, no scheduler",
    "scheduled": "1 grouped allreduce, scheduler",
    "scheduled_16": "16 allreduces, scheduler",
    "hook_alone": "the scheduler's work alone (no run)",
}


def worker(args):
    """Time every variant's step."""
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import matex
    from matex.legacy import _schedule, _session

    world = MPI.COMM_WORLD
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        h, variables = x, []
        for i in range(LAYERS):
            w = tf.Variable(tf.random.stateless_normal([WIDTH, WIDTH], seed=[i, 1]) * 0.1)
            b = tf.Variable(tf.zeros([WIDTH]))
            variables += [w, b]
            h = tf.nn.tanh(tf.matmul(h, w) + b)
        loss = tf.reduce_mean(tf.square(h))
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
        grads = tf.compat.v1.gradients(loss, variables)
        steps = {
            "plain": opt.apply_gradients(zip(grads, variables)),
            "grouped": opt.apply_gradients(zip(matex.grouped_allreduce(grads), variables)),
            "many": opt.apply_gradients(zip([matex.allreduce(gr) for gr in grads], variables)),
        }
        init = tf.compat.v1.global_variables_initializer()
    feed = {x: np.random.default_rng(world.Get_rank()).normal(size=(ROWS, WIDTH))
            .astype("float32")}
    session = tf.compat.v1.Session(graph=g)
    session.run(init)
    rounds = 5 if args.quick else 25
    calls = 20 if args.quick else 100

    def variant(step, scheduled):
        def measure():
            if scheduled:
                _session.add_run_hook(_schedule.HOOK_NAME, _schedule._hook, innermost=True)
            else:
                _session.remove_run_hook(_schedule.HOOK_NAME)
            try:
                return _common.per_call(lambda: session.run(step, feed), calls, world.Barrier)
            finally:
                _session.add_run_hook(_schedule.HOOK_NAME, _schedule._hook, innermost=True)
        return measure

    for step in steps.values():   # plans and kernels made outside the timing
        session.run(step, feed)
    measures = {"plain": variant(steps["plain"], True),
                "unscheduled": variant(steps["grouped"], False),
                "scheduled": variant(steps["grouped"], True),
                "scheduled_16": variant(steps["many"], True),
                "hook_alone": lambda: _common.per_call(
                    lambda: _schedule._hook(lambda *a: None, session, steps["grouped"], feed),
                    calls, world.Barrier)}
    ms = {k: v * 1e3 for k, v in _common.interleave(measures, rounds).items()}
    _common.emit(_common.worst_over_ranks(world, {"ms_per_step": ms}), world.Get_rank())


def report(results):
    """The table and the ratios."""
    ms = results["worker"]["ms_per_step"]
    rows = [[description, "%.3f" % ms[name], "%.2fx" % (ms[name] / ms["plain"])]
            for name, description in VARIANTS.items()]
    cost = ms["scheduled"] - ms["unscheduled"]
    lines = [_common.table(["variant", "ms/step", "vs plain"], rows), "",
             "scheduler: %+.3f ms/step (%.3fx the unscheduled step); its own work alone "
             "%.3f ms/step" % (cost, ms["scheduled"] / ms["unscheduled"], ms["hook_alone"]),
             _common.target("scheduler <= 1.10x the unscheduled step",
                            ms["scheduled"] <= 1.10 * ms["unscheduled"],
                            "%.3fx" % (ms["scheduled"] / ms["unscheduled"]))]
    return "\n".join(lines)


def main():
    """Driver (no ``--worker``) or the worker phase."""
    _common.single_phase_main(__file__, __doc__.splitlines()[0], worker, report,
                              "TF1 graph scheduler: %d layers of %dx%d, 2 ranks"
                              % (LAYERS, WIDTH, WIDTH))


if __name__ == "__main__":
    main()
