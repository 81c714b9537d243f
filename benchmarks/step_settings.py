"""What two settings of ``fit``'s step cost at 2 ranks: the commit vote, and fusion's overlap.

    python benchmarks/step_settings.py            # full run
    python benchmarks/step_settings.py --quick    # smoke run

Both settings are read when the step is traced, so each variant is its own
model, trained alternately in the same 2 ranks (``import matex.keras``, batch
32 per rank, Adam, an accuracy metric) on ``small_models.py``'s CNN (keras-io's
mnist_convnet, 35 k parameters: one bucket) and 5.8 M-parameter MLP (23 MB of
gradients: 3 buckets of at most 16 MiB):

- ``default``: as shipped (the vote, 16 MiB buckets);
- ``no vote`` (``MATEX_COMMIT_VOTE=0``): the step without the commit vote
  (``matex._commit``: one sum per gradient, one more scalar in the fused
  buffer, a ``tf.cond`` around the update);
- ``one bucket`` (``MATEX_FUSION_THRESHOLD`` 1 GiB): every gradient in one
  allreduce, which cannot start before the whole backward pass is done, so
  nothing of it is hidden;
- ``per gradient`` (``MATEX_FUSION_THRESHOLD=0``): one allreduce per gradient,
  each free to start when its gradient is ready (in program order);
- ``allreduce alone``: the default step's reductions (same buckets, the
  gradients' shapes) in a ``tf.function`` of their own, nothing else: the
  communication a step has to hide.

How much of the allreduce the default step hides behind the backward pass:
``(one bucket - default) / allreduce alone``. Per step, the first step of
every ``fit`` excluded: CPU ms of the process and wall ms, medians over
measurements, worse rank.
"""

import contextlib
import os

import _common
import small_models

MODELS = ("cnn", "mlp_6m")
SETTINGS = {   # variant -> the environment its step is traced under
    "default": {},
    "no vote": {"MATEX_COMMIT_VOTE": "0"},
    "one bucket": {"MATEX_FUSION_THRESHOLD": str(1 << 30)},
    "per gradient": {"MATEX_FUSION_THRESHOLD": "0"},
}


@contextlib.contextmanager
def environment(values):
    """``os.environ`` updated with ``values`` inside, put back after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def allreduce_alone(tf, model, calls):
    """Wall ms of the default step's gradient reductions alone (the rows count and the
    vote riding with them), on zeros of the gradients' shapes, after a barrier."""
    from matex import _collectives, _fusion

    grads = [tf.zeros([])] * 2 + [tf.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    reduce = tf.function(lambda: _fusion.allreduce_gradients(grads, "sum"))
    reduce()
    return _common.per_call(reduce, calls, barrier=_collectives.barrier) * 1e3


def worker(args):
    """Both models in every setting, alternately; per-step CPU and wall ms."""
    import keras
    import numpy as np
    import tensorflow as tf

    import matex.keras  # noqa: F401 - fit as under matexrun
    from matex import _runtime

    size, rank = _runtime.size(), _runtime.rank()
    steps, measurements, warmup, seq_len = small_models.settings(args.quick)
    batch = small_models.PER_RANK_BATCH * size
    variants = {}
    for name in MODELS:
        for setting in SETTINGS:
            keras.utils.set_random_seed(0)
            variants[name, setting] = small_models.build(keras, np, name, batch * steps, seq_len)

    def measure(key):
        model, x, y = variants[key]
        with environment(SETTINGS[key[1]]):
            return small_models.fit_step_ms(keras, model, x, y, batch)

    def alone(name):
        return {"wall_ms": allreduce_alone(tf, variants[name, "default"][0], steps)}

    measures = {key: (lambda key=key: measure(key)) for key in variants}
    measures.update({(name, "allreduce alone"): (lambda name=name: alone(name))
                     for name in MODELS})
    samples = _common.interleave(measures, measurements, warmup)
    figures = {name: {setting: samples[name, setting]
                      for setting in list(SETTINGS) + ["allreduce alone"]} for name in MODELS}
    figures = _common.worst_over_ranks(_runtime.control(), figures)
    _common.emit({"ranks": size, "models": figures}, rank)


def report(results):
    """Per model: each setting's ms per step; the vote's cost and the hidden allreduce."""
    rows = []
    for name in MODELS:
        got = results["worker"]["models"][name]
        default, alone = got["default"], got["allreduce alone"]["wall_ms"]
        hidden = got["one bucket"]["wall_ms"] - default["wall_ms"]
        rows.append([name] + ["%.2f" % got[s]["wall_ms"] for s in SETTINGS] + [
            "%.2f" % alone,
            "%.3f" % (default["cpu_ms"] / got["no vote"]["cpu_ms"]),
            "%.3f" % (default["wall_ms"] / got["no vote"]["wall_ms"]),
            "%.2f (%.0f %%)" % (hidden, 100 * hidden / alone)])
    return _common.table(
        ["model (2 ranks)"] + ["%s, ms" % s for s in SETTINGS]
        + ["allreduce alone, ms", "vote: CPU ratio", "vote: wall ratio",
           "allreduce hidden, ms (share)"], rows)


def main():
    _common.single_phase_main(__file__, __doc__.splitlines()[0], worker, report,
                              "fit step settings")


if __name__ == "__main__":
    main()
