"""Horovod's synthetic benchmark: MaTEx ``--horovod`` against Horovod 0.28.1, and plain TF.

Usage:

    python benchmarks/horovod_synthetic.py                       # driver: every phase, rounds
    python benchmarks/horovod_synthetic.py --quick               # smoke run (tiny images)
    python benchmarks/horovod_synthetic.py --horovod-python /tmp/hvd-venv/bin/python

One worker body, the shape of Horovod's ``tensorflow2_synthetic_benchmark.py``
written against Horovod's API (``import horovod.tensorflow as hvd``):
``hvd.init()``, a ``tf.keras.applications`` model with random weights, SGD,
one batch of random images and labels, a ``tf.function`` step with
``hvd.DistributedGradientTape`` and, after the first step,
``hvd.broadcast_variables`` of the model's and optimizer's variables; warm-up
batches, then ``--num-iters`` timed runs of ``--num-batches-per-iter`` batches.
Its figure is images per second over all ranks (median of the timed runs, as
rank 0 sees them), and rank 0's CPU time per step (all its threads).

The driver runs the same file nine ways, alternating, ``--rounds`` times (the
machine is shared: ratios are taken within one run), keeping each phase's
median:

- ``horovod``, 1 and 2 ranks: real Horovod 0.28.1 in the interpreter
  ``--horovod-python`` (its own virtualenv: TensorFlow 2.16, Keras 2 as
  ``tf_keras`` with ``TF_USE_LEGACY_KERAS=1``), ``horovodrun --gloo``;
- ``matex``, 1 and 2 ranks: ``matexrun --horovod -np N`` in this interpreter
  (TensorFlow 2.21, Keras 3): ``import horovod.tensorflow`` is MaTEx's
  ``matex.horovod``;
- ``matex-k2``, 1 and 2 ranks: the same with ``TF_USE_LEGACY_KERAS=1``, so
  that ``tf.keras`` is Keras 2 (``tf_keras`` 2.21) as in Horovod's phases: the
  like-for-like comparison of the two distributed layers;
- ``plain``, one process per stack, no Horovod at all (``--plain``: the
  frameworks' own difference: TF 2.16 + Keras 2, TF 2.21 + Keras 3, TF 2.21 +
  Keras 2).

When ``--horovod-python`` is missing or cannot import ``horovod.tensorflow``,
its three rows say "not run" and the rest runs. Horovod is never a MaTEx
dependency: its virtualenv is built apart (see ``docs/performance.md``).

A worker by hand: ``python benchmarks/horovod_synthetic.py --worker hvd`` under
``horovodrun`` or ``python -m matex --horovod``; ``--worker hvd --plain``
without either.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common

HOROVOD_PYTHON = "/tmp/hvd-venv/bin/python"
TIMEOUT = 900


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="MobileNetV3Small",
                        help="a tf.keras.applications model (default MobileNetV3Small), or "
                             "'tiny' (two small convolutions, for tests)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2,
                        help="driver: run every phase this many times, alternating "
                             "(default 2: about 10 minutes on 2 busy cores)")
    parser.add_argument("--quick", action="store_true",
                        help="driver: 1 round of tiny runs (32x32 images, 1 timed batch)")
    parser.add_argument("--horovod-python", default=HOROVOD_PYTHON,
                        help="the interpreter of Horovod's virtualenv (default %s)"
                             % HOROVOD_PYTHON)
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    parser.add_argument("--worker", choices=["hvd"], help="run the benchmark body itself")
    parser.add_argument("--plain", action="store_true",
                        help="worker: one process, no Horovod (plain TensorFlow)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.image_size = 1, 32
        args.num_warmup_batches, args.num_batches_per_iter, args.num_iters = 1, 1, 1
    return args


# ---- worker -----------------------------------------------------------------

def build_model(keras, name, image_size):
    """``keras.applications.<name>`` with random weights, 1000 classes; ``tiny``: two small
    convolutions (for the driver's test: traced in a second, in Keras 2 and 3 alike)."""
    shape = (image_size, image_size, 3)
    if name != "tiny":
        return getattr(keras.applications, name)(weights=None, input_shape=shape)
    return keras.Sequential([
        keras.Input(shape),
        keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
        keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(1000, activation="softmax"),
    ])


def worker(args):
    """Horovod's synthetic benchmark body; prints one result line on rank 0."""
    import tensorflow as tf

    if args.plain:
        hvd, rank, size = None, 0, 1
    else:
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

    model = build_model(tf.keras, args.model, args.image_size)
    optimizer = tf.keras.optimizers.SGD(0.01)
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(target, probs))
        if hvd is not None:
            tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        if first_batch and hvd is not None:
            # after the first step, so that the optimizer's variables exist
            variables = optimizer.variables
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(variables() if callable(variables) else variables,
                                    root_rank=0)

    start = time.perf_counter()
    step(True)
    first_s = time.perf_counter() - start
    for _ in range(args.num_warmup_batches):
        step(False)
    rates, cpu_ms = [], []
    for _ in range(args.num_iters):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step(False)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        rates.append(size * args.batch_size * args.num_batches_per_iter / wall)
        cpu_ms.append(cpu * 1e3 / args.num_batches_per_iter)
    version = _common.package_version
    _common.emit({"ranks": size, "img_s": statistics.median(rates),
                  "cpu_ms_step": statistics.median(cpu_ms), "first_step_s": first_s,
                  "tensorflow": tf.__version__,
                  "keras": "tf_keras " + version("tf_keras")
                  if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras " + version("keras"),
                  "horovod": None if hvd is None else hvd.__name__ + " "
                  + version("horovod", "matex")}, rank)


# ---- driver -----------------------------------------------------------------

PHASES = (   # name, framework, ranks
    ("plain-tf216", "horovod", 0), ("horovod-1", "horovod", 1), ("horovod-2", "horovod", 2),
    ("plain-tf221", "matex", 0), ("matex-1", "matex", 1), ("matex-2", "matex", 2),
    # the same script with tf.keras as Keras 2 (tf_keras 2.21), as Horovod's phases have it
    ("plain-tf221-k2", "matex-k2", 0), ("matex-k2-1", "matex-k2", 1),
    ("matex-k2-2", "matex-k2", 2),
)


def horovod_missing(python):
    """Why Horovod's interpreter cannot run the Horovod phases, or None when it can."""
    if not os.path.exists(python):
        return "%s does not exist" % python
    proc = subprocess.run([python, "-c", "import horovod.tensorflow"], capture_output=True,
                          text=True, env=horovod_env(), timeout=300)
    if proc.returncode:
        return "%s cannot import horovod.tensorflow: %s" % (
            python, (proc.stderr.strip().splitlines() or ["?"])[-1])
    return None


def horovod_env():
    """Horovod's phases: Keras 2 (tf_keras) as tf.keras, no MaTEx variables."""
    env = {k: v for k, v in _common.launch_env().items() if not k.startswith("MATEX_")}
    env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def worker_args(args):
    return ["--worker", "hvd", "--model", args.model, "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size),
            "--num-warmup-batches", str(args.num_warmup_batches),
            "--num-batches-per-iter", str(args.num_batches_per_iter),
            "--num-iters", str(args.num_iters)]


def phase_command(name, framework, ranks, args):
    """(command, environment) of one phase."""
    script = os.path.abspath(__file__)
    body = worker_args(args) + (["--plain"] if ranks == 0 else [])
    if framework == "horovod":
        python = args.horovod_python
        if ranks == 0:
            return [python, script] + body, horovod_env()
        horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
        return ([horovodrun, "-np", str(ranks), "-H", "localhost:%d" % ranks, "--gloo",
                 python, script] + body, horovod_env())
    env = _common.launch_env()
    env.pop("TF_USE_LEGACY_KERAS", None)
    if framework == "matex-k2":
        env["TF_USE_LEGACY_KERAS"] = "1"
    if ranks == 0:
        return [sys.executable, script] + body, env
    # matexrun, as a user runs it (it adds mpiexec's --bind-to none on one machine)
    return [sys.executable, "-m", "matex.launcher", "--horovod", "-np", str(ranks),
            script] + body, env


def run_phase(name, framework, ranks, args):
    """Rank 0's result dict of one phase."""
    cmd, env = phase_command(name, framework, ranks, args)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit("phase %s timed out after %ss: %s" % (name, TIMEOUT, " ".join(cmd))) \
            from exc
    # horovodrun prefixes every line with its rank ("[0]<stdout>:")
    results = [line.split(_common.RESULT_MARK, 1)[1] for line in proc.stdout.splitlines()
               if _common.RESULT_MARK in line]
    if proc.returncode or len(results) != 1:
        raise SystemExit("phase %s failed (exit %d): %s\n%s\n%s" % (
            name, proc.returncode, " ".join(cmd), proc.stdout[-3000:], proc.stderr[-5000:]))
    return json.loads(results[0])


def run_all(args, phases):
    """Every phase ``args.rounds`` times, the order rotating each round; per phase the
    median of each figure and every round's img/s."""
    runs = {name: [] for name, _, _ in phases}
    for r in range(args.rounds):
        shift = r % len(phases)
        for name, framework, ranks in phases[shift:] + phases[:shift]:
            runs[name].append(run_phase(name, framework, ranks, args))
    merged = {}
    for name, results in runs.items():
        merged[name] = dict(results[0])
        for key in ("img_s", "cpu_ms_step", "first_step_s"):
            merged[name][key] = statistics.median(r[key] for r in results)
        merged[name]["img_s_rounds"] = [r["img_s"] for r in results]
    return merged


LABELS = {"plain-tf216": ("plain TF, no Horovod", "TF 2.16 + Keras 2 (tf_keras)"),
          "horovod-1": ("Horovod 0.28.1 (gloo)", "TF 2.16 + Keras 2 (tf_keras)"),
          "horovod-2": ("Horovod 0.28.1 (gloo)", "TF 2.16 + Keras 2 (tf_keras)"),
          "plain-tf221": ("plain TF, no Horovod", "TF 2.21 + Keras 3"),
          "matex-1": ("MaTEx --horovod", "TF 2.21 + Keras 3"),
          "matex-2": ("MaTEx --horovod", "TF 2.21 + Keras 3"),
          "plain-tf221-k2": ("plain TF, no Horovod", "TF 2.21 + Keras 2 (tf_keras)"),
          "matex-k2-1": ("MaTEx --horovod", "TF 2.21 + Keras 2 (tf_keras)"),
          "matex-k2-2": ("MaTEx --horovod", "TF 2.21 + Keras 2 (tf_keras)")}
COUNTERPART = {"plain-tf221": "plain-tf216", "matex-1": "horovod-1", "matex-2": "horovod-2",
               "plain-tf221-k2": "plain-tf216", "matex-k2-1": "horovod-1",
               "matex-k2-2": "horovod-2"}
ONE_RANK = {"horovod-2": "horovod-1", "matex-2": "matex-1", "matex-k2-2": "matex-k2-1"}
PLAIN = {"horovod": "plain-tf216", "matex": "plain-tf221", "matex-k2": "plain-tf221-k2"}


def report(results, args):
    """The table: img/s per phase and the ratios, each the quotient of two figures shown."""
    shown = {name: float("%.1f" % r["img_s"]) for name, r in results.items() if r}

    def ratio(a, b):
        return "%.2f" % (shown[a] / shown[b]) if a in shown and b in shown else "-"

    rows = []
    for name, framework, ranks in PHASES:
        r = results.get(name)
        label, stack = LABELS[name]
        rows.append([label, stack, str(max(ranks, 1)),
                     "%.1f" % shown[name] if r else "not run",
                     "%.0f" % r["cpu_ms_step"] if r else "-",
                     ratio(name, COUNTERPART[name]) if name in COUNTERPART else "-",
                     ratio(name, PLAIN[framework]) if ranks else "-",
                     ratio(name, ONE_RANK[name]) if name in ONE_RANK else "-"])
    return "\n".join([
        _common.table(["phase", "stack", "ranks", "img/s", "CPU ms/step (rank 0)",
                       "x TF 2.16 counterpart", "x plain 1 process (same stack)",
                       "x own 1 rank"], rows),
        "",
        "%s, batch %d per rank, %dx%d images; img/s over all ranks, median of %d timed runs of "
        "%d batches (after %d warm-up) and of %d rounds, phases alternating. 'x TF 2.16 "
        "counterpart': MaTEx against Horovod at the same ranks, plain TF 2.21 against plain "
        "TF 2.16. CPU ms: rank 0's process time per step, all threads (at 2 ranks with the "
        "wait for the peer)."
        % (args.model, args.batch_size, args.image_size, args.image_size, args.num_iters,
           args.num_batches_per_iter, args.num_warmup_batches, args.rounds),
    ])


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    missing = horovod_missing(args.horovod_python)
    phases = [p for p in PHASES if not (missing and p[1] == "horovod")]
    results = run_all(args, phases)
    command = " ".join(["python benchmarks/horovod_synthetic.py"] + sys.argv[1:])
    print(_common.header("Horovod's synthetic benchmark: MaTEx --horovod against Horovod "
                         "0.28.1", command))
    if missing:
        print("Horovod phases not run: %s\n" % missing)
    else:
        r = results["horovod-1"]
        print("Horovod phases: %s, tensorflow %s, %s\n" % (r["horovod"], r["tensorflow"],
                                                             r["keras"]))
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"results": results, "horovod_missing": missing}, out, indent=1,
                      sort_keys=True)


if __name__ == "__main__":
    main()
