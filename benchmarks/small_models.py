"""Per-step cost of small recurrent models under MaTEx vs plain Keras (issue #24 item 16).

    python benchmarks/small_models.py            # full run
    python benchmarks/small_models.py --quick    # smoke run (2 ranks only)

Two keras-io-like models on synthetic data, trained by ``fit`` on NumPy
arrays with Adam and an accuracy metric, batch 32 per process:

- ``addition_rnn``: LSTM(128) encoder, RepeatVector, LSTM(128) decoder,
  TimeDistributed Dense softmax (keras-io's addition_rnn);
- ``bidirectional_lstm``: Embedding(20000, 128), 2x Bidirectional(LSTM(64)),
  Dense sigmoid (keras-io's bidirectional_lstm_imdb).

Two phases, each one ``import matex.keras`` process per rank (as under
``matexrun``): ``ranks1`` (1 rank) and ``ranks2`` (2 ranks). In each, every
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
plain Keras in the same processes.
"""

import contextlib
import time

import _common

PER_RANK_BATCH = 32
MODELS = ("addition_rnn", "bidirectional_lstm")


def settings(quick):
    """(steps per measurement, measurements per model, unmeasured rounds, bidirectional
    sequence length)."""
    return (6, 1, 0, 20) if quick else (30, 5, 1, 200)


def build(keras, np, name, rows, seq_len):
    """The compiled model ``name`` and ``rows`` rows of synthetic data for it."""
    rng = np.random.default_rng(0)
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


def worker(args):
    """Both models, plain Keras and MaTEx, alternately; per-step CPU/wall time, op counts."""
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

    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.ends = getattr(self, "ends", []) + [(time.process_time(), time.perf_counter())]

    def measure(key):
        model, x, y, batch = variants[key]
        ends = StepEnds()
        with plain_keras() if key[1] == "keras" else contextlib.nullcontext():
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                      callbacks=[ends])
        (cpu0, wall0), (cpu1, wall1) = ends.ends[0], ends.ends[-1]
        n = len(ends.ends) - 1   # from the end of the 1st step (which may trace)
        return {"cpu_ms": (cpu1 - cpu0) * 1e3 / n, "wall_ms": (wall1 - wall0) * 1e3 / n}

    keys = list(variants)
    samples = {key: [] for key in keys}
    for r in range(warmup + measurements):   # every variant once per round, order rotating
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            value = measure(key)
            if r >= warmup:
                samples[key].append(value)
    figures = {name: {} for name in MODELS}
    for (name, kind), values in samples.items():
        figures[name][kind] = _common.median_merge(values)
        ops, matex_ops = step_ops(variants[name, kind][0])
        figures[name][kind].update(ops=ops, matex_ops=matex_ops)
    figures = _common.worst_over_ranks(_runtime.control(), figures)
    _common.emit({"ranks": size, "models": figures}, rank)


KINDS = ("keras", "matex")
PHASES = (("ranks1", 1), ("ranks2", 2))
LABELS = {("ranks1", "keras"): "1 process, plain Keras", ("ranks1", "matex"): "1 rank, matex",
          ("ranks2", "keras"): "2 processes, plain Keras each",
          ("ranks2", "matex"): "2 ranks, matex"}


def report(results):
    """One row per model, phase and kind; CPU ratio against plain Keras in the same processes."""
    rows = []
    for name in MODELS:
        for phase in (p for p, _ in PHASES if p in results):
            models = results[phase]["models"][name]
            for kind in KINDS:
                figures = models[kind]
                rows.append([name, LABELS[phase, kind], "%.2f" % figures["cpu_ms"],
                             "%.2f" % figures["wall_ms"], "%d" % figures["ops"],
                             "%d" % figures["matex_ops"],
                             "%.2f" % (figures["cpu_ms"] / models["keras"]["cpu_ms"])])
    return "\n".join([
        _common.table(["model", "configuration", "CPU ms/step", "wall ms/step", "step ops",
                       "MaTEx ops", "CPU x plain Keras"], rows),
        "",
        "Batch %d per process. CPU ms: the process's CPU time per step (all threads; the worse "
        "rank); at 2 ranks MaTEx's includes MPI's busy wait for the peer. Plain Keras runs in "
        "the same processes, alternating with MaTEx." % PER_RANK_BATCH,
    ])


def main():
    """Driver (no ``--worker``) or one worker phase."""
    args = _common.parse_args(__doc__.splitlines()[0], [p[0] for p in PHASES], repeats=3)
    if args.worker:
        return worker(args)
    extra = ["--quick"] if args.quick else []
    # --quick: the 2-rank phase alone (each phase traces all four models: most of its time)
    phases = {name: dict(nranks=n, args=extra) for name, n in PHASES
              if n > 1 or not args.quick}
    results = _common.run_phases(__file__, phases, args.repeats)
    command = "python benchmarks/small_models.py" + (" --quick" if args.quick else "")
    print(_common.header("small models: per-step cost, matex vs plain Keras", command))
    print(report(results))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
