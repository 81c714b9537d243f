"""What the commit vote costs a ``fit`` step: 2 ranks, with and without it, in one run.

    python benchmarks/commit_vote.py            # full run
    python benchmarks/commit_vote.py --quick    # smoke run

``fit``'s step carries each rank's commit vote in the gradients' fused
allreduce (``matex._commit``): one sum per gradient to find a NaN or an
infinity, one more scalar in the fused buffer, and a ``tf.cond`` around the
update. ``MATEX_COMMIT_VOTE=0`` (read when the step is traced) builds the step
without it. Both run in the same 2 ranks (``import matex.keras``, batch 32 per
rank, Adam, an accuracy metric), alternately, on ``small_models.py``'s CNN
(keras-io's mnist_convnet) and 5.8 M-parameter MLP (the largest gradient per
step of that set). Per step, first step of every ``fit`` excluded: CPU ms of
the process (``time.process_time``) and wall ms, medians over measurements,
worse rank; the ratio is with the vote over without it.
"""

import contextlib
import os
import time

import _common
import small_models

MODELS = ("cnn", "mlp_6m")
KINDS = ("vote", "no_vote")


@contextlib.contextmanager
def _vote(kind):
    """MATEX_COMMIT_VOTE for the step traced inside (the first ``fit`` traces it)."""
    before = os.environ.get("MATEX_COMMIT_VOTE")
    os.environ["MATEX_COMMIT_VOTE"] = "1" if kind == "vote" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MATEX_COMMIT_VOTE"]
        else:
            os.environ["MATEX_COMMIT_VOTE"] = before


def worker(args):
    """Both models, with and without the vote, alternately; per-step CPU and wall ms."""
    import keras
    import numpy as np

    import matex.keras  # noqa: F401 - fit as under matexrun
    from matex import _runtime

    size, rank = _runtime.size(), _runtime.rank()
    steps, measurements, warmup, seq_len = small_models.settings(args.quick)
    batch = small_models.PER_RANK_BATCH * size
    variants = {}
    for name in MODELS:
        for kind in KINDS:
            keras.utils.set_random_seed(0)
            variants[name, kind] = small_models.build(keras, np, name, batch * steps, seq_len)

    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.ends = getattr(self, "ends", []) + [(time.process_time(), time.perf_counter())]

    def measure(key):
        model, x, y = variants[key]
        ends = StepEnds()
        with _vote(key[1]):
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                      callbacks=[ends])
        (cpu0, wall0), (cpu1, wall1) = ends.ends[0], ends.ends[-1]
        n = len(ends.ends) - 1   # from the end of the 1st step (which traces)
        return {"cpu_ms": (cpu1 - cpu0) * 1e3 / n, "wall_ms": (wall1 - wall0) * 1e3 / n}

    keys = list(variants)
    samples = {key: [] for key in keys}
    for r in range(warmup + measurements):   # every variant once per round, order rotating
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            value = measure(key)
            if r >= warmup:
                samples[key].append(value)
    figures = {name: {kind: _common.median_merge(samples[name, kind]) for kind in KINDS}
               for name in MODELS}
    figures = _common.worst_over_ranks(_runtime.control(), figures)
    _common.emit({"ranks": size, "models": figures}, rank)


def report(results):
    """One row per model: per-step ms with and without the vote, and their ratios."""
    rows = []
    for name in MODELS:
        with_vote = results["worker"]["models"][name]["vote"]
        without = results["worker"]["models"][name]["no_vote"]
        rows.append([name, "%.2f" % without["cpu_ms"], "%.2f" % with_vote["cpu_ms"],
                     "%.3f" % (with_vote["cpu_ms"] / without["cpu_ms"]),
                     "%.2f" % without["wall_ms"], "%.2f" % with_vote["wall_ms"],
                     "%.3f" % (with_vote["wall_ms"] / without["wall_ms"])])
    return _common.table(["model (2 ranks)", "CPU ms, no vote", "CPU ms, vote", "CPU ratio",
                          "wall ms, no vote", "wall ms, vote", "wall ratio"], rows)


def main():
    _common.single_phase_main(__file__, __doc__.splitlines()[0], worker, report,
                              "commit vote")


if __name__ == "__main__":
    main()
