"""One process, no mpiexec: plain Keras first, then `import matex.keras`, on the same model,
data and seeds. Prints JSON: the op types of each traced training step (``train_step``, and
a custom loop's step with ``matex.DistributedGradientTape``) and whether the trained
weights are bitwise equal. Used by tests/test_transparency.py."""

import collections
import json

import keras
import numpy as np
import tensorflow as tf

SPECS = (tf.TensorSpec((32, 28, 28, 1), tf.float32), tf.TensorSpec((32,), tf.int64))


def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(10)])
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def op_types(function):
    """Every op of ``function``'s graph and of the functions it calls, counted by type."""
    graph = function.get_concrete_function(*SPECS).graph.as_graph_def()
    return collections.Counter([n.op for n in graph.node] + [
        n.op for f in graph.library.function for n in f.node_def])


def loop_step(m, wrap):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        tape = wrap(tape)
        grads = tape.gradient(loss, m.trainable_variables)
        m.optimizer.apply(grads, m.trainable_variables)
        return loss
    return step


rng = np.random.default_rng(0)
x = rng.random((128, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, 128)
result = {}
for kind in ("plain", "matex"):
    if kind == "matex":
        import matex.keras  # noqa: F401 - from here on Keras is MaTEx's

        import matex
        wrap = matex.DistributedGradientTape
    else:
        wrap = lambda tape: tape  # noqa: E731
    m = model()
    m.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    result[kind] = {
        "weights": [w.tolist() for w in m.get_weights()],
        "step_ops": op_types(tf.function(lambda a, b: m.train_step((a, b)))),
        "loop_ops": op_types(loop_step(m, wrap)),
    }
print(json.dumps({"same_weights": result["plain"]["weights"] == result["matex"]["weights"],
                  **{"%s_%s" % (kind, key): result[kind][key] for kind in result
                     for key in ("step_ops", "loop_ops")}}))
