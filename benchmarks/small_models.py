"""Per-step cost and throughput of keras-io-like models under MaTEx vs plain Keras.

    python benchmarks/small_models.py            # full run
    python benchmarks/small_models.py --quick    # smoke run (2 ranks only)
    python benchmarks/small_models.py --phases ranks1 --repeats 5   # 1 rank, longer

Four keras-io-like models on synthetic data, trained by ``fit`` on NumPy
arrays with Adam and an accuracy metric, batch 32 per process:

- ``cnn``: keras-io's mnist_convnet (Conv2D(32), MaxPool, Conv2D(64), MaxPool,
  Flatten, Dropout, Dense softmax) on 28x28x1;
- ``mlp_6m``: Dense(2048), Dense(2048), Dense(10) on 784 inputs (5.8 M
  parameters: a large gradient for a small step);
- ``addition_rnn``: LSTM(128) encoder, RepeatVector, LSTM(128) decoder,
  TimeDistributed Dense softmax (keras-io's addition_rnn);
- ``bidirectional_lstm``: Embedding(20000, 128), 2x Bidirectional(LSTM(64)),
  Dense sigmoid (keras-io's bidirectional_lstm_imdb, an LSTM text classifier).

Three phases. ``ranks1`` (1 rank) and ``ranks2`` (2 ranks) run one
``import matex.keras`` process per rank (as under ``matexrun``). ``mwms2``
runs 2 workers of TensorFlow's MultiWorkerMirroredStrategy (gRPC, ring), each
model's step as a custom loop, 32 samples per worker. In each, every
process trains each model twice over, alternately: with MaTEx (global batch
32 x ranks, 32 per rank) and as plain Keras (MaTEx's patches set aside while
it compiles and fits, ``plain_keras``; batch 32 on its own data), so both
kinds run under the same load, and at 2 ranks plain Keras runs as two
independent processes side by side. The figures are per training step, first
step of every ``fit`` excluded: **CPU ms** of the process (all its threads,
``time.process_time``; on a machine shared with other jobs the wall clock
mostly measures the others; for MaTEx at 2 ranks it includes MPI's busy wait
for the peer), wall ms, and the ops of the traced step (its graph and every
function it calls; ``Matex*``: MaTEx's collectives). Figures are medians over
rounds (worse rank) and over ``--repeats`` runs; the ratio compares with
plain Keras in the same processes. **Samples/s** (all ranks' samples per
wall second) and the speed-up against one plain Keras process (the 1-rank
phase's) say whether distributing pays: MaTEx at 2 ranks trains 2 x 32
samples per step.
"""

import contextlib
import time

import _common

PER_RANK_BATCH = 32
MODELS = ("cnn", "mlp_6m", "addition_rnn", "bidirectional_lstm")


def settings(quick):
    """(steps per measurement, measurements per model, unmeasured rounds, bidirectional
    sequence length)."""
    return (6, 1, 0, 20) if quick else (30, 5, 1, 200)


def build(keras, np, name, rows, seq_len):
    """The compiled model ``name`` and ``rows`` rows of synthetic data for it."""
    rng = np.random.default_rng(0)
    if name in ("cnn", "mlp_6m"):
        if name == "cnn":
            layers = [keras.Input((28, 28, 1)),
                      keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                      keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
                      keras.layers.Flatten(), keras.layers.Dropout(0.5)]
            x = rng.random((rows, 28, 28, 1), dtype=np.float32)
        else:
            layers = [keras.Input((784,)), keras.layers.Dense(2048, activation="relu"),
                      keras.layers.Dense(2048, activation="relu")]
            x = rng.random((rows, 784), dtype=np.float32)
        model = keras.Sequential(layers + [keras.layers.Dense(10, activation="softmax")])
        model.compile(loss="sparse_categorical_crossentropy", optimizer="adam",
                      metrics=["accuracy"])
        return model, x, rng.integers(0, 10, rows)
    if name == "addition_rnn":
        digits, chars = 3, 12
        maxlen = 2 * digits + 1
        model = keras.Sequential([
            keras.Input((maxlen, chars)),
            keras.layers.LSTM(128),
            keras.layers.RepeatVector(digits + 1),
            keras.layers.LSTM(128, return_sequences=True),
            keras.layers.TimeDistributed(keras.layers.Dense(chars, activation="softmax")),
        ])
        model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
        x = rng.integers(0, 2, (rows, maxlen, chars)).astype(bool)
        # float64, as keras.utils.to_categorical gives it
        y = keras.utils.to_categorical(rng.integers(0, chars, (rows, digits + 1)), chars)
        return model, x, y
    model = keras.Sequential([
        keras.Input((seq_len,), dtype="int32"),
        keras.layers.Embedding(20000, 128),
        keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True)),
        keras.layers.Bidirectional(keras.layers.LSTM(64)),
        keras.layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    x = rng.integers(0, 20000, (rows, seq_len)).astype("int32")
    y = rng.integers(0, 2, rows)
    return model, x, y


def step_ops(model):
    """(ops, MaTEx ops) of the traced training step: its graph and the functions it calls."""
    total = matex_ops = 0
    for cell in model.train_function.__closure__ or ():
        function = cell.cell_contents
        if not hasattr(function, "_list_all_concrete_functions"):
            continue
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            types = [n.op for n in graph.node] + [n.op for f in graph.library.function
                                                  for n in f.node_def]
            total += len(types)
            matex_ops += sum(1 for t in types if t.startswith("Matex"))
    return total, matex_ops


@contextlib.contextmanager
def plain_keras():
    """Keras's own compile, fit, step and metrics while inside (MaTEx's patches set aside).

    A model compiled and trained inside is a plain Keras model in the same
    process, so the two are measured alternately under the same load.
    """
    from matex import _compat

    trainer, tf_trainer = _compat.trainer_class(), _compat.tf_trainer_class()
    patched = [(trainer, "compile"), (trainer, "get_metrics_result"), (tf_trainer, "fit"),
               (tf_trainer, "train_step"), (_compat.base_optimizer_class(), "apply")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name, function in saved:
        setattr(owner, name, function._matex_original)
    try:
        yield
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)


def fit_step_ms(keras, model, x, y, batch):
    """``model.fit`` over ``x``, ``y`` once: per-step CPU ms of this process (all its
    threads) and wall ms, from the end of the first step (which may trace) to the end of
    the last."""
    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.ends = getattr(self, "ends", []) + [(time.process_time(), time.perf_counter())]

    ends = StepEnds()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[ends])
    (cpu0, wall0), (cpu1, wall1) = ends.ends[0], ends.ends[-1]
    n = len(ends.ends) - 1
    return {"cpu_ms": (cpu1 - cpu0) * 1e3 / n, "wall_ms": (wall1 - wall0) * 1e3 / n}


def worker(args):
    """Every model, plain Keras and MaTEx, alternately; per-step CPU/wall time, op counts."""
    import keras
    import numpy as np

    import matex.keras  # noqa: F401 - fit as under matexrun
    from matex import _runtime

    size, rank = _runtime.size(), _runtime.rank()
    steps, measurements, warmup, seq_len = settings(args.quick)
    variants = {}
    for kind in KINDS:   # plain Keras: batch 32 on every process; MaTEx: global 32 x ranks
        batch = PER_RANK_BATCH * (size if kind == "matex" else 1)
        for name in MODELS:
            keras.utils.set_random_seed(0)
            with plain_keras() if kind == "keras" else contextlib.nullcontext():
                variants[name, kind] = build(keras, np, name, batch * steps, seq_len) + (batch,)

    def measure(key):
        model, x, y, batch = variants[key]
        with plain_keras() if key[1] == "keras" else contextlib.nullcontext():
            return fit_step_ms(keras, model, x, y, batch)

    samples = _common.interleave({key: (lambda key=key: measure(key)) for key in variants},
                                 measurements, warmup)
    figures = {name: {} for name in MODELS}
    for (name, kind), values in samples.items():
        figures[name][kind] = values
        ops, matex_ops = step_ops(variants[name, kind][0])
        figures[name][kind].update(ops=ops, matex_ops=matex_ops)
    figures = _common.worst_over_ranks(_runtime.control(), figures)
    _common.emit({"ranks": size, "models": figures}, rank)


def worker_mwms(args):
    """MultiWorkerMirroredStrategy, one worker per rank (ring), 32 samples per worker per
    step: each model's step as a custom loop (``fit`` fails under MWMS in Keras 3.15),
    the compiled loss, ``optimizer.apply``; per-step CPU/wall time (worse worker)."""
    strategy = _common.mwms_strategy()
    import keras
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    steps, measurements, warmup, seq_len = settings(args.quick)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    batch = PER_RANK_BATCH * world.Get_size()
    figures = {}
    for name in MODELS:
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model, x, y = build(keras, np, name, batch, seq_len)
            model.optimizer.build(model.trainable_variables)
        x = x.astype("float32") if x.dtype == bool else x
        y = y.astype("float32") if y.dtype == np.float64 else y
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
        iterator = iter(strategy.experimental_distribute_dataset(data.with_options(options)))

        def replica_step(x, y, model=model):
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables)
            return loss

        step = tf.function(lambda it, replica_step=replica_step: strategy.run(
            replica_step, args=next(it)))
        step(iterator)   # traced, first step
        samples = []
        for r in range(warmup + measurements):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                step(iterator)
            if r >= warmup:
                samples.append({"cpu_ms": (time.process_time() - cpu0) * 1e3 / steps,
                                "wall_ms": (time.perf_counter() - wall0) * 1e3 / steps})
        figures[name] = {"mwms": _common.median_merge(samples)}
    figures = _common.worst_over_ranks(world, figures)
    _common.emit({"ranks": world.Get_size(), "models": figures}, world.Get_rank())


KINDS = ("keras", "matex")
PHASES = (("ranks1", 1), ("ranks2", 2), ("mwms2", 2))
LABELS = {("ranks1", "keras"): "1 process, plain Keras", ("ranks1", "matex"): "1 rank, matex",
          ("ranks2", "keras"): "2 processes, plain Keras each",
          ("ranks2", "matex"): "2 ranks, matex",
          ("mwms2", "mwms"): "2 workers, MWMS (custom loop)"}


def report(results):
    """One row per model, phase and kind; CPU ratio against plain Keras in the same processes."""
    rows = []
    for name in MODELS:
        one = results.get("ranks1", {}).get("models", {}).get(name, {}).get("keras")
        for phase, nranks in ((p, n) for p, n in PHASES if p in results):
            models = results[phase]["models"][name]
            for kind in (k for k in KINDS + ("mwms",) if k in models):
                figures = models[kind]
                ranks = 1 if kind == "keras" else nranks   # plain Keras: one process's
                rate = ranks * PER_RANK_BATCH * 1e3 / figures["wall_ms"]
                rows.append([name, LABELS[phase, kind], "%.2f" % figures["cpu_ms"],
                             "%.2f" % figures["wall_ms"],
                             "%d" % figures["ops"] if "ops" in figures else "-",
                             "%d" % figures["matex_ops"] if "ops" in figures else "-",
                             "%.2f" % (figures["cpu_ms"] / models["keras"]["cpu_ms"])
                             if "keras" in models else "-",
                             "%.0f" % rate,
                             "%.2f" % (rate * one["wall_ms"] / (PER_RANK_BATCH * 1e3))
                             if one else "-"])
    return "\n".join([
        _common.table(["model", "configuration", "CPU ms/step", "wall ms/step", "step ops",
                       "MaTEx ops", "CPU x plain Keras", "samples/s",
                       "x 1 plain process"], rows),
        "",
        "Batch %d per process. CPU ms: the process's CPU time per step (all threads; the worse "
        "rank); at 2 ranks MaTEx's includes MPI's busy wait for the peer. Plain Keras runs in "
        "the same processes, alternating with MaTEx. Samples/s: per wall second, over all "
        "ranks for MaTEx and MWMS, of one process for plain Keras; 'x 1 plain process': "
        "against plain Keras in the 1-rank phase (not run with --quick). MWMS runs its own "
        "processes, a custom loop without metrics (its step ops are not counted: -)."
        % PER_RANK_BATCH,
    ])


def main():
    """Driver (no ``--worker``) or one worker phase."""
    args = _common.parse_args(__doc__.splitlines()[0], [p[0] for p in PHASES], repeats=3,
                              choose_phases=True)
    if args.worker:
        return (worker_mwms if args.worker == "mwms2" else worker)(args)
    extra = ["--quick"] if args.quick else []
    # --quick: the 2-rank phase alone (each phase traces all four models: most of its time)
    phases = {name: dict(nranks=n, args=extra) for name, n in PHASES
              if (n > 1 or not args.quick) and name in args.phases}
    results = _common.run_phases(__file__, phases, args.repeats)
    command = "python benchmarks/small_models.py" + (" --quick" if args.quick else "") + (
        " --phases " + ",".join(args.phases) if len(args.phases) < len(PHASES) else "")
    print(_common.header("small models: per-step cost, matex vs plain Keras", command))
    print(report(results))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
