"""CPU defaults per rank: TensorFlow's compute threads and MPI's wait policy (issue #33 item 3).

    python benchmarks/cpu_defaults.py            # full run
    python benchmarks/cpu_defaults.py --quick    # smoke run (fewer steps)

Two keras-io-like models on synthetic data, trained by ``fit`` with
``import matex.keras`` (as under ``matexrun``), batch 32 per rank: a small CNN
(two Conv2D, 28x28x1 inputs) and ``addition_rnn`` (LSTM(128) encoder,
RepeatVector, LSTM(128) decoder). Phases, alternating, ``--repeats`` times:

- ``plain``: one process of plain Keras (``python -m mpi4py`` without MaTEx's
  patches: the reference, TensorFlow's default threads);
- ``tf-busy``: 2 MaTEx ranks with TensorFlow's default threads
  (``MATEX_INTRA_OP_THREADS=tf``: each rank sizes its pool to every core) and
  Open MPI's busy polling (``MATEX_MPI_WAIT=poll``);
- ``auto-busy``: 2 ranks with MaTEx's default threads (each rank's share of the
  node's cores) and busy polling;
- ``auto-yield``: MaTEx's defaults: those threads, and a waiting rank yields its
  core (``mpi_yield_when_idle``).

Figures: samples/s over all ranks (timed steps after two untimed epochs'
first steps, the slower rank's wall time), and each against ``plain``.
"""

import time

import _common
import small_models

PER_RANK_BATCH = 32
MODELS = ("cnn", "addition_rnn")
PHASES = {
    "plain": dict(nranks=1, mpi_args=[]),
    "tf-busy": dict(nranks=2, mpi_args=["-x", "MATEX_INTRA_OP_THREADS=tf",
                                        "-x", "MATEX_MPI_WAIT=poll"]),
    "auto-busy": dict(nranks=2, mpi_args=["-x", "MATEX_INTRA_OP_THREADS=auto",
                                          "-x", "MATEX_MPI_WAIT=poll"]),
    "auto-yield": dict(nranks=2, mpi_args=["-x", "MATEX_INTRA_OP_THREADS=auto",
                                           "-x", "MATEX_MPI_WAIT=yield"]),
}


def build(keras, np, name, rows):
    """The compiled model ``name`` and ``rows`` rows of synthetic data for it
    (``addition_rnn``: ``small_models``' own)."""
    rng = np.random.default_rng(0)
    if name == "cnn":
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ])
        x = rng.random((rows, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, rows)
        model.compile(loss="sparse_categorical_crossentropy", optimizer="adam",
                      metrics=["accuracy"])
        return model, x, y
    model, x, y = small_models.build(keras, np, name, rows, seq_len=None)   # addition_rnn
    return model, x.astype("float32"), y


def worker(args):
    """Train each model; samples/s over every rank (the slower rank's time)."""
    from mpi4py import MPI

    distributed = args.worker != "plain"
    if distributed:
        import matex.keras  # noqa: F401 - fit as under matexrun; MaTEx sizes the threads
    import keras
    import numpy as np

    size = MPI.COMM_WORLD.Get_size()
    steps = 10 if args.quick else 60
    result = {}
    for name in MODELS:
        global_batch = PER_RANK_BATCH * size
        rows = global_batch * steps
        model, x, y = build(keras, np, name, rows)
        model.fit(x[:global_batch * 2], y[:global_batch * 2], batch_size=global_batch,
                  epochs=1, verbose=0)   # traced, warmed
        MPI.COMM_WORLD.Barrier()
        started = time.perf_counter()
        model.fit(x, y, batch_size=global_batch, epochs=1, verbose=0)
        seconds = MPI.COMM_WORLD.allreduce(time.perf_counter() - started, MPI.MAX)
        result[name] = {"samples_per_s": rows / seconds}
    _common.emit(result, MPI.COMM_WORLD.Get_rank())


def report(results):
    rows = []
    for name in MODELS:
        plain = results["plain"][name]["samples_per_s"]
        for phase in PHASES:
            rate = results[phase][name]["samples_per_s"]
            rows.append([name, phase, "%d" % PHASES[phase]["nranks"], "%.0f" % rate,
                         "%.2f" % (rate / plain)])
    return "\n".join([
        _common.table(["model", "configuration", "processes", "samples/s", "x plain Keras"],
                      rows),
        "",
        "Batch %d per process; every figure from the same run, phases alternating."
        % PER_RANK_BATCH,
    ])


def main():
    """Driver (no ``--worker``) or one worker phase."""
    args = _common.parse_args(__doc__.splitlines()[0], list(PHASES), repeats=3)
    if args.worker:
        return worker(args)
    extra = ["--quick"] if args.quick else []
    phases = {name: dict(spec, args=extra) for name, spec in PHASES.items()}
    results = _common.run_phases(__file__, phases, args.repeats)
    command = "python benchmarks/cpu_defaults.py" + (" --quick" if args.quick else "")
    print(_common.header("CPU defaults per rank: compute threads and MPI's wait policy",
                         command))
    print(report(results))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
