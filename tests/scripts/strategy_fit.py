"""Test script (never mentions MaTEx): tf.distribute strategy scripts, Keras-guide style.

Usage: strategy_fit.py OUT.json

Runs, in one process, each with its own model built and compiled inside
``strategy.scope()``:

* ``mwms``: ``MultiWorkerMirroredStrategy()`` without TF_CONFIG (created
  first: it configures TensorFlow's collectives at start-up);
* ``mirrored``: ``MirroredStrategy()`` (one CPU device here);
* ``onedevice``: ``OneDeviceStrategy("/cpu:0")``;

each: fit with validation data, evaluate, predict;

* ``loop``: a custom loop under ``MirroredStrategy()`` (``strategy.run`` in a
  ``tf.function``, ``optimizer.apply_gradients`` in the replica context),
  each process on its share of every batch (rows ``rank::size``; alone: all);
* ``central``, ``central_loop``: compiling under ``CentralStorageStrategy``
  (not one MaTEx supports across ranks), and a custom loop's step under it:
  the outcomes are recorded.

Also records TF_CONFIG as the script sees it, and the MWMS cluster.

Each process seeds Keras with its rank (OMPI_COMM_WORLD_RANK, 0 alone), so
ranks build different initial weights and one process builds rank 0's.
Writes OUT.<rank>.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

out = sys.argv[1]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
mwms = tf.distribute.MultiWorkerMirroredStrategy()

rng = np.random.default_rng(0)
x = rng.normal(size=(90, 5)).astype("float32")
y = (x @ np.linspace(-1, 2, 5).astype("float32") + 0.5 * np.sin(x[:, 0]))[:, None]
x_train, y_train, x_val, y_val = x[:69], y[:69], x[69:], y[69:]   # 69 = 4 * 16 + 5: 3 + 2 rows
results = {"tf_config": os.environ.get("TF_CONFIG"),
           "mwms_cluster": mwms.cluster_resolver.cluster_spec().as_dict()}


def build(seed):
    keras.utils.set_random_seed(1000 * seed + rank)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def weights(model):
    return [w.tolist() for w in model.get_weights()]


for seed, (kind, strategy) in enumerate([
        ("mwms", mwms),
        ("mirrored", tf.distribute.MirroredStrategy()),
        ("onedevice", tf.distribute.OneDeviceStrategy("/cpu:0"))]):
    with strategy.scope():
        model = build(seed)
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
    initial = weights(model)
    history = model.fit(x_train, y_train, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        validation_data=(x_val, y_val))
    results[kind] = {
        "replicas": strategy.num_replicas_in_sync, "initial": initial,
        "weights": weights(model), "iterations": int(model.optimizer.iterations.numpy()),
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, batch_size=8, verbose=0),
        "predict": model.predict(x_val, batch_size=8, verbose=0).tolist()}

def train_step_of(strategy, model, optimizer):
    """A custom loop's step: ``strategy.run`` in a tf.function, apply in the replica context."""
    @tf.function
    def train_step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica_step, args=(xb, yb))
    return train_step


def outcome(fn):
    """"ok", or the error ``fn`` raised (the outcome is the result)."""
    try:
        fn()
        return "ok"
    except Exception as exc:   # noqa: BLE001
        return "%s: %s" % (type(exc).__name__, exc)


strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    model = build(7)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
initial = weights(model)
train_step = train_step_of(strategy, model, optimizer)
for epoch in range(2):
    for start in range(0, 64, 16):
        train_step(x[start:start + 16][rank::size], y[start:start + 16][rank::size])
results["loop"] = {"replicas": strategy.num_replicas_in_sync, "initial": initial,
                   "weights": weights(model), "iterations": int(optimizer.iterations.numpy())}

central = tf.distribute.experimental.CentralStorageStrategy()
with central.scope():
    model = build(8)
    optimizer = keras.optimizers.SGD(0.1)


def central_compile():
    with central.scope():
        model.compile(optimizer="sgd", loss="mse")


results["central"] = outcome(central_compile)
results["central_loop"] = outcome(lambda: train_step_of(central, model, optimizer)(x[:16], y[:16]))

with open("%s.%d" % (out, rank), "w") as f:
    json.dump(results, f)
