"""Models and checks shared by the pipeline suites (test_pipeline_2ranks/_4ranks)."""

import keras
import numpy as np

import matex
from matex.parallel._pipeline import PipelineModel
from matex.parallel._stages import StageBoundary

BATCH, ROWS = 16, 64


def mlp(stages, seed=3, width=12, depth=4):
    """A Sequential MLP of ``depth`` hidden layers with ``stages - 1`` StageBoundary layers."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,))]
    per = depth // stages
    for i in range(depth):
        layers.append(keras.layers.Dense(width, activation="tanh", name="h%d" % i))
        if stages > 1 and (i + 1) % per == 0 and (i + 1) // per < stages:
            layers.append(StageBoundary(name="cut%d" % ((i + 1) // per)))
    layers.append(keras.layers.Dense(3, name="out"))
    return keras.Sequential(layers)


def cnn(stages, seed=5):
    """A small functional CNN (conv, pool, conv, dense) cut into 2 or 4 stages."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(inp)
    if stages == 4:
        h = StageBoundary(name="cut1")(h)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="c2")(h)
    if stages >= 2:
        h = StageBoundary(name="cut2")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(10, activation="relu", name="fc")(h)
    if stages == 4:
        h = StageBoundary(name="cut3")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inp, out)


def regression(shape, seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows,) + shape).astype("float32")
    y = rng.normal(size=(rows, 3)).astype("float32")
    return x, y


def compile_(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def train_and_compare(build, shape, microbatches, schedule, grid=None, epochs=2, seed=0):
    """Train a pipeline and the plain model (same initial weights) on every rank; compare.

    Returns (pipeline model, its History, the reference model, its History).
    """
    x, y = regression(shape, seed)
    ref = compile_(build())
    href = ref.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    pm = compile_(PipelineModel(build(), microbatches=microbatches, schedule=schedule,
                                grid=grid))
    h = pm.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    for layer in pm.stage.layers:
        if not layer.weights or isinstance(layer, keras.layers.InputLayer):
            continue
        for a, b in zip(layer.weights, ref.get_layer(layer.name).weights):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                                       err_msg="%s on rank %d" % (a.path, matex.rank()))
    for key in ("loss", "mae"):
        np.testing.assert_allclose(h.history[key], href.history[key], rtol=1e-4)
    return pm, h, ref, href


def same_everywhere(comm, value):
    """Whether ``value`` (picklable) is equal on every rank of ``comm``."""
    everyone = comm.allgather(value)
    return all(v == everyone[0] for v in everyone)
