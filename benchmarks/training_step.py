"""Training throughput of a small CNN: 1 process vs 2 matex ranks vs 2 MWMS workers.

    python benchmarks/training_step.py            # full run
    python benchmarks/training_step.py --quick    # smoke run

Synthetic 28x28x1 data, global batch 128, plain SGD, two kinds of step:
Keras ``model.fit`` (with an accuracy metric) and a custom ``tf.function``
loop (forward, loss, gradients, ``optimizer.apply``; no metrics).

- ``single``: one process, plain Keras, batch 128, not bound to a core; fit
  with ``jit_compile`` False and True, and the custom loop;
- ``matex``: 2 ranks, ``matex.DistributedOptimizer``, each rank its own half
  of the data at batch 64; fit with ``jit_compile=False``, fit with
  ``jit_compile=True`` (MaTEx then splits the step: forward, backward and
  metrics XLA-compiled, allreduce and update outside), and the custom loop;
- ``mwms``: 2 workers of MultiWorkerMirroredStrategy (ring), batch 128 split
  by the strategy; custom loop only, as Keras 3.15's ``fit`` fails under this
  strategy (keras-team/keras#20585).

Ranks and workers are bound one per core (Open MPI's default for 2 ranks).
``jit_compile=False`` is what Keras's "auto" picks on CPU; the 1-process
``jit_compile=True`` fit separates XLA's own cost on this CPU from the
split's. A process's variants are measured alternately, after one unmeasured
round (tracing, compiling, building). A fit measurement runs a fixed number
of steps and is timed from the end of its first step to the end of its last;
a loop measurement times that many steps. Figures are medians over
measurements, and over ``--repeats`` runs of the phases; each configuration
is compared with the 1-process run of the same kind of step.
"""

import time

import _common

GLOBAL_BATCH = 128
SAMPLES = 4096
SINGLE_PROCESS_BINDING = ["--bind-to", "none"]


def build_model(keras):
    """conv 3x3x16 -> pool -> conv 3x3x32 -> pool -> dense 64 -> dense 10."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def compile_model(keras, model, optimizer, jit_compile):
    """Compile for sparse labels with logits, reporting accuracy."""
    model.compile(optimizer=optimizer, jit_compile=jit_compile, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def dataset(tf, part, parts, batch, samples=SAMPLES):
    """Part ``part`` of ``parts`` of ``samples`` synthetic images, batched and repeated forever."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    share = samples // parts
    lo = part * share
    data = tf.data.Dataset.from_tensor_slices((x[lo:lo + share], y[lo:lo + share]))
    return data.batch(batch, drop_remainder=True).cache().repeat().prefetch(2)


def settings(quick):
    """(steps per measurement, measurements per variant)."""
    return (6, 2) if quick else (40, 9)


def fit_measure(keras, model, data, steps):
    """A measurement: seconds per step of one ``fit`` of ``steps`` steps, first step excluded."""
    class StepEnds(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    def measure():
        ends = StepEnds()
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[ends])
        return (ends.ends[-1] - ends.ends[0]) / (len(ends.ends) - 1)
    return measure


def loop_measure(tf, keras, model, optimizer, data, steps, loss_batch, strategy=None):
    """A measurement: seconds per step of ``steps`` steps of a custom tf.function loop.

    The step is what ``fit``'s is, minus metrics: forward, loss averaged over
    ``loss_batch`` samples, gradients, ``optimizer.apply``. With ``strategy``
    it runs per replica through ``strategy.run`` on the distributed dataset.
    """
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_sample = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_sample, global_batch_size=loss_batch)
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)
        return loss

    if strategy is None:
        iterator = iter(data)
        step = tf.function(lambda it: replica_step(*next(it)))
    else:
        iterator = iter(strategy.experimental_distribute_dataset(data))
        step = tf.function(lambda it: strategy.run(replica_step, args=next(it)))
    return lambda: _common.per_call(lambda: step(iterator), steps)


def _throughput(seconds_per_step):
    return {"samples_per_s": GLOBAL_BATCH / seconds_per_step, "ms_per_step": seconds_per_step * 1e3}


def worker_single(args):
    """Plain Keras in one process: fit (jit_compile False and True), custom loop."""
    import keras
    import tensorflow as tf

    steps, measurements = settings(args.quick)
    data = dataset(tf, 0, 1, GLOBAL_BATCH)
    measures = {}
    for name, jit in (("single_fit", False), ("single_fit_xla", True)):
        model = build_model(keras)
        compile_model(keras, model, keras.optimizers.SGD(0.01), jit_compile=jit)
        measures[name] = fit_measure(keras, model, data, steps)
    model = build_model(keras)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    measures["single_loop"] = loop_measure(tf, keras, model, optimizer, data, steps, GLOBAL_BATCH)
    seconds = _common.interleave(measures, measurements)
    _common.emit({name: _throughput(s) for name, s in seconds.items()})


def worker_matex(args):
    """matex.DistributedOptimizer on 2 ranks: fit (jit_compile False and True), custom loop."""
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    import matex

    world = MPI.COMM_WORLD
    steps, measurements = settings(args.quick)
    local_batch = GLOBAL_BATCH // matex.size()
    data = dataset(tf, matex.rank(), matex.size(), local_batch)
    measures = {}
    for name, jit in (("matex_fit", False), ("matex_fit_xla", True)):
        model = build_model(keras)
        optimizer = matex.DistributedOptimizer(keras.optimizers.SGD(0.01))
        compile_model(keras, model, optimizer, jit_compile=jit)
        measures[name] = fit_measure(keras, model, data, steps)
    model = build_model(keras)
    optimizer = matex.DistributedOptimizer(keras.optimizers.SGD(0.01))
    optimizer.build(model.trainable_variables)  # eagerly: broadcasts rank 0's weights
    measures["matex_loop"] = loop_measure(tf, keras, model, optimizer, data, steps, local_batch)
    seconds = _common.worst_over_ranks(world, _common.interleave(measures, measurements))
    _common.emit({name: _throughput(s) for name, s in seconds.items()}, world.Get_rank())


def worker_mwms(args):
    """MultiWorkerMirroredStrategy on 2 workers, custom loop, global batch split by the strategy.

    Not ``fit``: with Keras 3.15 ``fit`` under this strategy fails while
    reducing the first batch and the step's logs (keras-team/keras#20585).
    """
    strategy = _common.mwms_strategy()
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    steps, measurements = settings(args.quick)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = dataset(tf, 0, 1, GLOBAL_BATCH).with_options(options)
    with strategy.scope():
        model = build_model(keras)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    measure = loop_measure(tf, keras, model, optimizer, data, steps, GLOBAL_BATCH, strategy)
    seconds = _common.worst_over_ranks(world, _common.interleave({"mwms_loop": measure},
                                                                   measurements))
    _common.emit({name: _throughput(s) for name, s in seconds.items()}, world.Get_rank())


ROWS = [
    # key, configuration, processes, the 1-process row it is compared with
    ("single_fit", "1 process, Keras fit, jit_compile=False", 1, "single_fit"),
    ("matex_fit", "2 ranks, matex, fit, jit_compile=False", 2, "single_fit"),
    ("single_fit_xla", "1 process, Keras fit, jit_compile=True", 1, "single_fit_xla"),
    ("matex_fit_xla", "2 ranks, matex, fit, jit_compile=True (split step)", 2,
     "single_fit_xla"),
    ("single_loop", "1 process, custom loop", 1, "single_loop"),
    ("matex_loop", "2 ranks, matex, custom loop", 2, "single_loop"),
    ("mwms_loop", "2 workers, MultiWorkerMirroredStrategy (ring), custom loop", 2,
     "single_loop"),
]


def report(results):
    """The table and the comparison lines."""
    figures = {}
    for phase in results.values():
        figures.update(phase)
    rows = [[label, str(n), "%.0f" % figures[key]["samples_per_s"],
             "%.1f" % figures[key]["ms_per_step"],
             "%.2f" % (figures[key]["samples_per_s"] / figures[base]["samples_per_s"])]
            for key, label, n, base in ROWS]
    lines = [_common.table(["configuration", "processes", "samples/s", "ms/step",
                            "x 1 process (same step)"], rows), ""]
    def ratio(key, other, figure):
        return figures[key][figure] / figures[other][figure]

    lines.append("matex vs MultiWorkerMirroredStrategy, same custom loop, 2 processes each: "
                 "%.2fx the samples/s." % ratio("matex_loop", "mwms_loop", "samples_per_s"))
    lines.append("matex fit step time, jit_compile=True (split) / jit_compile=False: %.2fx "
                 "(%.1f vs %.1f ms); XLA alone, 1 process without split: %.2fx."
                 % (ratio("matex_fit_xla", "matex_fit", "ms_per_step"),
                    figures["matex_fit_xla"]["ms_per_step"], figures["matex_fit"]["ms_per_step"],
                    ratio("single_fit_xla", "single_fit", "ms_per_step")))
    lines.append("MultiWorkerMirroredStrategy runs a custom loop: Keras 3.15 fit fails under it "
                 "(keras-team/keras#20585).")
    return "\n".join(lines)


def main():
    """Driver (no ``--worker``) or one worker phase."""
    args = _common.parse_args(__doc__.splitlines()[0], ["single", "matex", "mwms"], repeats=3)
    workers = {"single": worker_single, "matex": worker_matex, "mwms": worker_mwms}
    if args.worker:
        return workers[args.worker](args)
    extra = ["--quick"] if args.quick else []
    phases = {
        "single": dict(nranks=1, args=extra, mpi_args=SINGLE_PROCESS_BINDING),
        "matex": dict(nranks=2, args=extra),
        "mwms": dict(nranks=2, args=extra),
    }
    results = _common.run_phases(__file__, phases, args.repeats)
    command = "python benchmarks/training_step.py" + (" --quick" if args.quick else "")
    print(_common.header("training step: small CNN, global batch %d" % GLOBAL_BATCH, command))
    print(report(results))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
