"""Test script: a tiny model trained by fit (run under ``python -m matex``) with a fused bucket.

Usage: timeline_fit.py OUT STEPS [api]

Trains STEPS steps in 2 epochs on 2 dense layers (4 variables, one fused
bucket), then writes OUT.<rank>.json: the History and the optimizer's step
count. "api": a custom loop instead of fit, its steps marked with
``matex.timeline.step``; starts and stops the timeline with
``matex.timeline.start`` and ``stop`` (directory OUT.timeline) instead of
the environment; in step 31, ranks 0 and 1 also run 5 allreduces on a
sub-communicator of theirs (its own order of collectives: the merge must pair
collectives by communicator and number on it, not by each process's count). With
TEST_H5 set, the rows come from that HDF5 file through ``matex.readers``.
"""

import json
import os
import sys

import keras
import numpy as np

out, steps = sys.argv[1], int(sys.argv[2])
api = "api" in sys.argv[3:]
batch = 16
rng = np.random.default_rng(0)
x = rng.normal(size=(batch * steps, 8)).astype("float32")
y = (x[:, :4].sum(1) > 0).astype("int64")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.SGD(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if api:   # a custom loop, its steps marked with matex.timeline.step
    import tensorflow as tf

    import matex
    from matex import timeline

    timeline.start(out + ".timeline", steps=os.environ.get("TEST_STEPS") or None)
    optimizer, loss_fn = model.optimizer, model.loss

    @tf.function
    def train(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        # compile's optimizer is distributed under python -m matex: it averages the gradients
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    from matex import _runtime

    per = batch // matex.size()
    losses = []
    sub_members = matex.rank() in (0, 1)
    slot = _runtime.register_comm(_runtime.comm().Split(0 if sub_members else 1, matex.rank()))
    for epoch in range(2):
        for i in range(steps):
            lo = i * batch + matex.rank() * per
            with timeline.step():
                losses.append(float(train(x[lo:lo + per], y[lo:lo + per])))
                if epoch * steps + i == 31 and sub_members:
                    for _ in range(5):
                        _runtime._core().allreduce(np.ones(3, np.float32), "float32", "sum",
                                                   comm=slot)

    class history:   # noqa: N801 - what the report below reads from fit's History
        history = {"loss": losses}
elif os.environ.get("TEST_H5"):   # the same rows through matex.readers (global batch 16)
    from matex.readers import DataSet

    data = DataSet(os.environ["TEST_H5"], features="x", labels="y", batch_size=batch,
                   shuffle=True, seed=0)
    history = model.fit(data.train, epochs=2, verbose=0)
else:
    history = model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
if api:
    timeline.stop()
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
with open("%s.%d.json" % (out, rank), "w") as f:
    json.dump({"history": history.history, "iterations": int(model.optimizer.iterations)}, f)
