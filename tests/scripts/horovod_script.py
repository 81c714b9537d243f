"""Test script written for Horovod (never mentions MaTEx): Keras fit, then a GradientTape loop.

Usage: python -m matex --horovod horovod_script.py OUT_PREFIX, or as the
module ``horovod_script`` (``-m``). Each rank writes OUT_PREFIX.rank<N>.json.

The data set is the same on every rank; each rank trains on its block of
every global batch of 16 rows (rows [16j + rB, 16j + rB + B) with B = 16 /
size), as a Horovod script shards its data. Each rank seeds Keras with a
different number, and the root of the broadcasts is the last rank (seeded
0), so alone the script computes what every rank count must compute.

1. ``fit`` with ``hvd.DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``
   and ``MetricAverageCallback``: final weights and loss history.
2. ``fit`` with ``LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)``:
   the learning rate at each batch and the epoch logs' ``lr``; then two
   ``LearningRateScheduleCallback`` (staircase, and per batch).
3. A GradientTape loop with ``hvd.DistributedGradientTape`` and
   ``hvd.broadcast_variables``: final weights.
4. Gradients of ``hvd.broadcast``/``hvd.allgather``/``hvd.reducescatter``; the
   error of an allreduce whose shapes differ between ranks, and a sum after it;
   what ``hvd.alltoall`` returns with and without splits.
5. ``hvd.broadcast_`` in a TF1 graph run by a ``Session``; two independent
   collectives fetched together (unchained, scheduled per run).
6. The error of collectives whose shapes differ between ranks, run by a
   ``Session`` and in a ``tf.function``.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

hvd.init()
out = sys.argv[1]
ROWS, GLOBAL_BATCH = 64, 16
SIZE, RANK = hvd.size(), hvd.rank()
B = GLOBAL_BATCH // SIZE
ROOT = SIZE - 1
SEED = SIZE - 1 - RANK   # the root's seed is 0 whatever the number of ranks

rng = np.random.default_rng(7)
x_all = rng.normal(size=(ROWS, 5)).astype("float32")
y_all = (x_all @ rng.normal(size=(5, 1)) + 0.3).astype("float32")


def mine(a):
    """This rank's block of every global batch."""
    return a.reshape(-1, SIZE, B, a.shape[-1])[:, RANK].reshape(-1, a.shape[-1])


x, y = mine(x_all), mine(y_all)


def make_model():
    keras.utils.set_random_seed(SEED)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


report = {"names": [hvd.__name__, hvd_tf.__name__, hvd.callbacks.__name__], "size": SIZE,
          "argv0": os.path.basename(sys.argv[0])}

# 1. fit
model = make_model()
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
history = model.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(ROOT),
                               hvd.callbacks.MetricAverageCallback()])
report["fit_weights"] = [w.tolist() for w in model.get_weights()]
report["fit_loss"] = [float(v) for v in history.history["loss"]]


# 2. warmup
class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate))


recorder = Recorder()
warm = make_model()
warm.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
history = warm.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                   callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1,
                                                                      warmup_epochs=2),
                              recorder])
report["warmup_rates"] = recorder.rates
report["warmup_logged_lr"] = [float(v) for v in history.history["lr"]]

# 2b. schedules: a constant multiplier (staircase) for epoch 1, a function per batch from 2
recorder = Recorder()
scheduled = make_model()
scheduled.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
scheduled.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1,
                                               end_epoch=2),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: e,
                                               start_epoch=2, staircase=False),
    recorder])
report["schedule_rates"] = recorder.rates

# 3. GradientTape loop
tape_model = make_model()
hvd_tf.broadcast_variables(tape_model.variables, root_rank=ROOT)
optimizer = keras.optimizers.SGD(0.05)
for epoch in range(2):
    for start in range(0, len(x), B):
        xb, yb = x[start:start + B], y[start:start + B]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tape_model(xb, training=True) - yb))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, tape_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, tape_model.trainable_variables))
report["tape_weights"] = [w.tolist() for w in tape_model.get_weights()]

# 4. Horovod's conventions: broadcast and allgather gradients averaged over ranks;
#    ranks that disagree on a shape get FailedPreconditionError, and go on
mine_x = tf.constant([float(RANK + 1)] * 2)
with tf.GradientTape(persistent=True) as tape:
    tape.watch(mine_x)
    broadcast = hvd_tf.broadcast(mine_x, root_rank=ROOT)
    gathered = hvd_tf.allgather(mine_x)
    broadcast_loss = tf.reduce_sum(broadcast * float(RANK + 1))
    gathered_loss = tf.reduce_sum(gathered * tf.range(1, 2 * SIZE + 1, dtype=tf.float32))
report["broadcast_grad"] = tape.gradient(broadcast_loss, mine_x).numpy().tolist()
report["allgather_grad"] = tape.gradient(gathered_loss, mine_x).numpy().tolist()
try:
    hvd_tf.allreduce(tf.ones([RANK + 1]))
    report["mismatch"] = None
except Exception as exc:  # noqa: BLE001 - the type is what the test checks
    report["mismatch"] = type(exc).__name__
report["sum_after"] = hvd_tf.allreduce(tf.constant([1.0]), op=hvd_tf.Sum).numpy().tolist()
report["fusion_threshold"] = os.environ.get("MATEX_FUSION_THRESHOLD")
# reducescatter's gradient (Horovod: size times the allgathered output gradient for Sum);
# alltoall returns the received splits only when given splits
scattered_x = tf.ones([2 * SIZE])
with tf.GradientTape() as tape:
    tape.watch(scattered_x)
    part = hvd_tf.reducescatter(scattered_x, op=hvd_tf.Sum)
    scattered_loss = tf.reduce_sum(part)
report["reducescatter_part"] = part.numpy().tolist()
report["reducescatter_grad"] = tape.gradient(scattered_loss, scattered_x).numpy().tolist()
group = [tf.ones([2 * SIZE, 3], tf.float64) for _ in range(2)]
with tf.GradientTape(persistent=True) as tape:
    for t in group:
        tape.watch(t)
    parts = hvd_tf.grouped_reducescatter(group, op=hvd_tf.Sum)
# a float32 output gradient for float64 outputs, as Horovod accepts
report["grouped_reducescatter_grad"] = [
    float(tf.reduce_sum(tape.gradient(p, t, tf.ones([2, 3])))) for p, t in zip(parts, group)]
report["alltoall"] = hvd_tf.alltoall(tf.fill([SIZE], RANK)).numpy().tolist()
received, received_splits = hvd_tf.alltoall(tf.fill([SIZE], RANK), splits=[1] * SIZE)
report["alltoall_splits"] = [received.numpy().tolist(), received_splits.numpy().tolist()]

# 5. TF1 graph mode: hvd.broadcast_ returns the assignments, run with them
with tf.Graph().as_default():
    variable = tf.compat.v1.Variable([float(RANK)] * 2)
    assigned, = hvd_tf.broadcast_([variable], ROOT)
    # independent collectives of one Session.run: no dependency between them (each runs
    # when fetched); the run's scheduler gives every rank the same order
    first = hvd_tf.allreduce(tf.ones([3]) * (RANK + 1), op=hvd_tf.Sum)
    second = hvd_tf.allgather(tf.fill([RANK + 1], RANK))
    report["graph_unchained"] = not any(
        op is first.op or first.op in op.control_inputs
        for op in [second.op] + [i.op for i in second.op.inputs])
    with tf.compat.v1.Session() as session:
        session.run(variable.initializer)
        report["graph_broadcast_"] = [session.run(assigned).tolist(),
                                      session.run(variable).tolist()]
        together = session.run([second, first])
        report["graph_together"] = [together[0].tolist(), together[1].tolist()]

# 6. ranks that disagree, in a graph: Horovod's FailedPreconditionError from Session.run
#    (which drops the payload the eager conversion reads) and from a tf.function; MaTEx's
#    own allreduce keeps InvalidArgumentError there
def mismatch_in_graph(make):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        try:
            session.run(make(tf.ones([RANK + 1])))
        except tf.errors.OpError as exc:
            return [type(exc).__name__, "ranks disagree on the collective" in exc.message]
    return None


@tf.function
def mismatch_in_function():
    return hvd_tf.allgather(tf.ones([2, RANK + 1]))


if SIZE > 1:
    import matex

    report["graph_mismatch"] = [mismatch_in_graph(hvd_tf.allreduce),
                                mismatch_in_graph(lambda t: hvd_tf.broadcast(t, ROOT)),
                                mismatch_in_graph(matex.allreduce)]
    try:
        mismatch_in_function()
    except tf.errors.OpError as exc:
        report["function_mismatch"] = type(exc).__name__

with open("%s.rank%d.json" % (out, RANK), "w") as f:
    json.dump(report, f)
