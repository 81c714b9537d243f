"""Benchmark recipes in the Deep500 spirit: a named training, run over seeds and rank counts.

``recipe(name, seeds=3, ranks=(1, 2), variants=("plain",))`` launches one
``mpiexec`` job per (variant, rank count, seed) -- each job runs this module
as a worker on every rank -- and collects one row per run: test accuracy,
time to a target test accuracy, training samples/s, scaling efficiency,
parameters (and, with apoptosis, parameters once dead units are removed),
the mean fraction of samples trained on (pruning). It writes, under ``out``:
``runs.csv`` (every run, rewritten after each run, so a failure loses
nothing done), ``summary.csv`` and ``report.md`` (every run, then per
variant and rank count the median and min/max of each figure) and
``report.png`` (every run as a point, the median as a bar).

Recipes: ``shapes`` (the demo's CNN on examples/shapes.py's 16x16 shapes,
4 classes) and ``mnist_cnn`` (Keras's MNIST CNN on generated 28x28 "digits":
10 stroke templates, shifted and noisy). Variants: ``plain``, ``apoptosis``
(``NeuronApoptosis``), ``pruning`` (``SamplePruning``), ``both``.

Measured per run: training time counts ``fit``'s epochs without the per-epoch
test evaluation; time to target is the training time at the end of the first
epoch whose test accuracy reaches ``target``, None if never; samples/s counts
the samples actually trained on (fewer with pruning); scaling efficiency is
samples/s / (ranks x the median samples/s of the same variant at the
smallest rank count run) x that rank count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from matex import _atomic

if TYPE_CHECKING:
    import pandas as pd

VARIANTS = ("plain", "apoptosis", "pruning", "both")


# -- data and models (worker side) -------------------------------------------------


def _shapes_data(samples: int):
    root = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(root))
    try:
        from shapes import make_shapes
    finally:
        sys.path.remove(str(root))
    x, y = make_shapes(samples, seed=1)
    xt, yt = make_shapes(2000, seed=2)
    return x, y, xt, yt, 4


def make_digits(n: int, seed: int = 0, size: int = 28, classes: int = 10):
    """MNIST-like generated data: ``(images float32 [n, size, size, 1], labels int64 [n])``.

    Each class is a fixed template of three strokes (from ``classes``' own
    seed, the same for every ``seed``); a sample is its template shifted by
    up to 3 pixels, scaled in intensity, with Gaussian noise.
    """
    templates = np.zeros((classes, size + 8, size + 8), np.float32)
    yy, xx = np.mgrid[0:size + 8, 0:size + 8]
    for c in range(classes):
        rng = np.random.default_rng(1000 + c)
        for _ in range(3):
            (y0, x0), (y1, x1) = rng.uniform(8, size, size=(2, 2))
            t = np.linspace(0, 1, 40)
            for py, px in zip(y0 + t * (y1 - y0), x0 + t * (x1 - x0)):
                templates[c] = np.maximum(templates[c], np.exp(-((yy - py) ** 2 + (xx - px) ** 2)
                                                               / 2.0))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=n)
    shifts = rng.integers(0, 9, size=(n, 2))
    scale = rng.uniform(0.6, 1.0, size=n).astype(np.float32)
    images = np.empty((n, size, size, 1), np.float32)
    for i in range(n):
        dy, dx = shifts[i]
        images[i, :, :, 0] = templates[labels[i], dy:dy + size, dx:dx + size] * scale[i]
    images += rng.normal(0, 0.3, size=images.shape).astype(np.float32)
    return images, labels.astype(np.int64)


def _digits_data(samples: int):
    x, y = make_digits(samples, seed=1)
    xt, yt = make_digits(2000, seed=2)
    return x, y, xt, yt, 10


def _shapes_model(keras, classes):
    return keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes),
    ])


def _digits_model(keras, classes):
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(classes),
    ])


# name -> (data(samples), model(keras, classes), defaults)
RECIPES = {
    "shapes": (_shapes_data, _shapes_model,
               {"samples": 12000, "epochs": 6, "batch_size": 64, "lr": 2e-3, "target": 0.95}),
    "mnist_cnn": (_digits_data, _digits_model,
                  {"samples": 12000, "epochs": 4, "batch_size": 64, "lr": 1e-3, "target": 0.95}),
}


def _worker(args) -> dict:
    """One training run on every rank of this job; rank 0 returns the row."""
    import keras
    import tensorflow as tf

    from matex import _batch_slicing, _collectives, _optimizer, _runtime
    from matex.science._apoptosis import NeuronApoptosis
    from matex.science._pruning import SamplePruning

    data_fn, model_fn, _ = RECIPES[args.recipe]
    rank, size = _runtime.rank(), _runtime.size()
    x, y, xt, yt, classes = data_fn(args.samples)
    keras.utils.set_random_seed(args.seed)
    model = model_fn(keras, classes)
    model.compile(optimizer=_optimizer.DistributedOptimizer(keras.optimizers.Adam(args.lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    share = len(x) // size                    # equal blocks: equal steps on every rank
    lo, hi = rank * share, (rank + 1) * share
    tlo, thi = _batch_slicing.slice_bounds(len(xt), rank, size)
    clock = {"train": 0.0, "start": None, "to_target": None, "curve": []}

    class Measure(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            clock["start"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            clock["train"] += time.perf_counter() - clock["start"]
            pred = np.argmax(np.asarray(self.model(xt[tlo:thi], training=False)), axis=1)
            correct = int((pred == yt[tlo:thi]).sum())
            acc = float(_collectives.allreduce(tf.constant(correct, tf.int64), "sum")) / len(xt)
            clock["curve"].append((clock["train"], acc))
            if clock["to_target"] is None and acc >= args.target:
                clock["to_target"] = clock["train"]

    callbacks = [Measure()]
    apoptosis = pruning = None
    if args.variant in ("apoptosis", "both"):
        apoptosis = NeuronApoptosis(x[lo:hi][:256], threshold=args.threshold, patience=2,
                                    warmup=1, verbose=False)
        callbacks.insert(0, apoptosis)
    if args.variant in ("pruning", "both"):
        pruning = SamplePruning((x, y), batch_size=args.batch_size, margin=args.margin,
                                full_pass_every=args.full_pass_every, seed=args.seed,
                                verbose=False)
        callbacks.insert(0, pruning)
        model.fit(pruning.dataset(), epochs=args.epochs, verbose=0, callbacks=callbacks)
        trained = sum(h["kept"] for h in pruning.history)
    else:
        model.fit(x[lo:hi], y[lo:hi], batch_size=args.batch_size // size, epochs=args.epochs,
                  shuffle=True, verbose=0, callbacks=callbacks)
        trained = share * size * args.epochs
    train_time = float(_collectives.allreduce(tf.constant(clock["train"], tf.float64), "max"))
    row = {"recipe": args.recipe, "variant": args.variant, "ranks": size, "seed": args.seed,
           "epochs": args.epochs, "samples": args.samples,
           "test_accuracy": clock["curve"][-1][1], "target": args.target,
           "time_to_target_s": clock["to_target"], "train_time_s": train_time,
           "samples_per_s": trained / train_time, "params": int(model.count_params()),
           "params_after": int(apoptosis.params_after) if apoptosis else int(
               model.count_params()),
           "kept_fraction": (float(np.mean([h["fraction"] for h in pruning.history]))
                             if pruning else 1.0),
           "curve": clock["curve"]}
    return row if rank == 0 else None


def _worker_main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m matex.science._recipes")
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--variant", choices=VARIANTS, default="plain")
    parser.add_argument("--seed", type=int, default=0)
    for name in ("samples", "epochs", "batch_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, required=True)
    for name in ("lr", "target", "threshold", "margin"):
        parser.add_argument("--" + name, type=float, required=True)
    parser.add_argument("--full-pass-every", type=int, required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    row = _worker(args)
    if row is not None:
        _atomic.write(args.json, json.dumps(row))


# -- driver ------------------------------------------------------------------------------


def _say(verbose, message):
    if verbose:
        print(message, flush=True)


def _check(name, seeds, ranks, variants):
    if name not in RECIPES:
        raise ValueError("unknown recipe %r; recipes: %s" % (name, ", ".join(sorted(RECIPES))))
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    ranks = [int(r) for r in ([ranks] if isinstance(ranks, int) else ranks)]
    variants = [variants] if isinstance(variants, str) else list(variants)
    if not seeds:
        raise ValueError("recipe: at least one seed")
    if not ranks or min(ranks) < 1:
        raise ValueError("recipe: rank counts must be >= 1, got %r" % (ranks,))
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError("recipe: unknown variants %s; variants: %s" % (bad, ", ".join(VARIANTS)))
    return seeds, ranks, variants


def recipe(name: str, seeds: int | Sequence[int] = 3, ranks: Sequence[int] = (1, 2),
           variants: Sequence[str] = ("plain",), out: str = "matex-bench",
           epochs: int | None = None, samples: int | None = None,
           batch_size: int | None = None, target: float | None = None,
           threshold: float = 0.1, margin: float = 2.0, full_pass_every: int = 3,
           timeout: float = 1800, mpi_args: Sequence[str] = (),
           verbose: bool = True) -> pd.DataFrame:
    """Run recipe ``name`` for every (variant, rank count, seed); return the runs as a DataFrame.

    ``seeds``: a count (seeds 0..n-1) or a list. ``ranks``: rank counts, one
    ``mpiexec`` job each. ``variants``: any of ``plain``, ``apoptosis``,
    ``pruning``, ``both``. ``epochs``/``samples``/``batch_size`` (global)/
    ``target`` (test accuracy) default to the recipe's. ``threshold``:
    ``NeuronApoptosis``'s; ``margin``/``full_pass_every``: ``SamplePruning``'s.
    Writes runs.csv, summary.csv, report.md and report.png under ``out``.
    Not a collective: call it from one process (it launches the jobs).
    """
    from matex import launcher

    seeds, ranks, variants = _check(name, seeds, ranks, variants)
    defaults = dict(RECIPES[name][2])
    settings = {"samples": samples or defaults["samples"], "epochs": epochs or defaults["epochs"],
                "batch_size": batch_size or defaults["batch_size"], "lr": defaults["lr"],
                "target": defaults["target"] if target is None else float(target),
                "threshold": threshold, "margin": margin, "full_pass_every": full_pass_every}
    for r in ranks:
        if settings["batch_size"] % r:
            raise ValueError("recipe: the global batch %d does not divide by %d ranks"
                             % (settings["batch_size"], r))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows, total = [], len(variants) * len(ranks) * len(seeds)
    for variant in variants:
        for r in ranks:
            for seed in seeds:
                path = out / ("run-%s-%s-r%d-s%d.json" % (name, variant, r, seed))
                program = [sys.executable, "-m", "matex.science._recipes", name,
                           "--variant", variant, "--seed", str(seed), "--json", str(path)]
                for key, value in settings.items():
                    program += ["--" + key.replace("_", "-"), str(value)]
                cmd = launcher.mpiexec_command(r, program, mpi_args=list(mpi_args))
                env = launcher.launch_env(None)
                env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
                started = time.time()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=timeout)
                if proc.returncode != 0 or not path.exists():
                    raise RuntimeError("recipe %s: run %s, %d ranks, seed %d failed (exit %d); "
                                       "finished runs are in %s\n%s" % (
                                           name, variant, r, seed, proc.returncode,
                                           out / "runs.csv", (proc.stdout + proc.stderr)[-3000:]))
                row = json.loads(path.read_text())
                rows.append(row)
                _say(verbose, "[%d/%d] %s %s ranks=%d seed=%d: test accuracy %.4f, %.1f s, "
                     "%.0f samples/s (%.0f s wall)" % (
                         len(rows), total, name, variant, r, seed, row["test_accuracy"],
                         row["train_time_s"], row["samples_per_s"], time.time() - started))
                _runs_frame(rows).to_csv(out / "runs.csv", index=False)
    runs = _runs_frame(rows)
    summary = summarize(runs)
    runs.to_csv(out / "runs.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    (out / "report.md").write_text(markdown_report(name, runs, summary, settings))
    plot_report(runs, out / "report.png", title="%s (%s)" % (name, ", ".join(variants)))
    _say(verbose, "recipe %s: %d runs; report in %s" % (name, len(runs), out / "report.md"))
    return runs


FIGURES = ("test_accuracy", "time_to_target_s", "train_time_s", "samples_per_s",
           "scaling_efficiency", "params_after", "kept_fraction")


def _runs_frame(rows):
    import pandas as pd

    runs = pd.DataFrame([{k: v for k, v in row.items() if k != "curve"} for row in rows])
    runs["time_to_target_s"] = pd.to_numeric(runs["time_to_target_s"], errors="coerce")
    eff = []
    for _, row in runs.iterrows():
        same = runs[runs["variant"] == row["variant"]]
        base_ranks = same["ranks"].min()
        base = same[same["ranks"] == base_ranks]["samples_per_s"].median()
        eff.append(row["samples_per_s"] / (row["ranks"] / base_ranks * base))
    runs["scaling_efficiency"] = eff
    return runs


def summarize(runs):
    """Per (variant, ranks): runs, and median / min / max of each figure (NaN-aware)."""
    import pandas as pd

    out = []
    for (variant, ranks), group in runs.groupby(["variant", "ranks"], sort=False):
        entry = {"variant": variant, "ranks": int(ranks), "runs": len(group),
                 "reached_target": int(group["time_to_target_s"].notna().sum())}
        for fig in FIGURES:
            values = group[fig].astype(float)
            entry[fig + "_median"] = values.median()
            entry[fig + "_min"] = values.min()
            entry[fig + "_max"] = values.max()
        out.append(entry)
    return pd.DataFrame(out)


def _fmt(value, digits=4):
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return ("%." + str(digits) + "g") % value


def markdown_report(name, runs, summary, settings) -> str:
    """Every run, then median [min, max] per variant and rank count, as markdown."""
    cols = ["variant", "ranks", "seed", "test_accuracy", "time_to_target_s", "train_time_s",
            "samples_per_s", "scaling_efficiency", "params", "params_after", "kept_fraction"]
    lines = ["# Recipe %s" % name, "",
             "Settings: " + ", ".join("%s=%s" % kv for kv in settings.items()), "",
             "## Every run", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    for _, row in runs.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    lines += ["", "## Median [min, max] per variant and rank count", "",
              "| variant | ranks | runs | reached target | " + " | ".join(FIGURES) + " |",
              "|" + "---|" * (4 + len(FIGURES))]
    for _, s in summary.iterrows():
        cells = ["%s [%s, %s]" % (_fmt(s[f + "_median"]), _fmt(s[f + "_min"]),
                                  _fmt(s[f + "_max"])) for f in FIGURES]
        lines.append("| %s | %d | %d | %d | %s |" % (s["variant"], s["ranks"], s["runs"],
                                                     s["reached_target"], " | ".join(cells)))
    return "\n".join(lines) + "\n"


def plot_report(runs, path, title=""):
    """Accuracy, time to target, samples/s, scaling efficiency, parameters: runs and medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("test_accuracy", "test accuracy"), ("time_to_target_s", "time to target (s)"),
              ("samples_per_s", "samples/s"), ("scaling_efficiency", "scaling efficiency"),
              ("params_after", "parameters (dead units removed)")]
    keys = list(dict.fromkeys(zip(runs["variant"], runs["ranks"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.2))
    for ax, (col, label) in zip(axes, panels):
        for i, (variant, ranks) in enumerate(keys):
            sel = runs[(runs["variant"] == variant) & (runs["ranks"] == ranks)]
            values = sel[col].astype(float).to_numpy()
            finite = values[np.isfinite(values)]
            if len(finite):
                ax.bar(i, np.median(finite), color="#9ecae1", width=0.6)
                ax.plot(np.full(len(finite), i), finite, "k.", markersize=5)
            missing = len(values) - len(finite)
            if missing:
                ax.text(i, 0, "%d not\nreached" % missing, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(["%s\n%d rk" % k for k in keys], fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(title + " (bar: median, dots: every run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    _worker_main()
