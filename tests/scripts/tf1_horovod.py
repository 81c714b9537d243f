"""A Horovod TF1 script, as written for Horovod (tests/test_legacy_tf1.py).

``python -m matex --horovod tf1_horovod.py OUT``: ``hvd.DistributedOptimizer``
over a v1 Adam optimizer, ``minimize(loss, global_step=)``, then
``sess.run(hvd.broadcast_global_variables(0))`` run alone with nothing fed, and
a ``feed_dict`` loop where each rank feeds its rows of the global batch (the
loss logged through ``hvd.allreduce``). Then the same model in a second graph
under ``MonitoredTrainingSession`` with ``hvd.BroadcastGlobalVariablesHook(0)``.
Initial values are offset by the rank (rank 0's are one process's). Writes
OUT.<rank> (JSON: losses and variables of both).
"""

import json
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

tf.compat.v1.disable_v2_behavior()
v1 = tf.compat.v1
hvd.init()

rng = np.random.RandomState(0)
X = rng.rand(24, 4).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
     + 0.1 * rng.randn(24, 1).astype(np.float32))
BATCH = 6   # divisible by 2 and 3


def build():
    init = np.random.RandomState(5)
    x = v1.placeholder(tf.float32, [None, 4])
    y = v1.placeholder(tf.float32, [None, 1])
    w1 = v1.get_variable("w1", initializer=init.randn(4, 3).astype(np.float32) + hvd.rank())
    b1 = v1.get_variable("b1", initializer=np.zeros(3, np.float32) - hvd.rank())
    w2 = v1.get_variable("w2", initializer=init.randn(3, 1).astype(np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) - y))
    step = v1.train.get_or_create_global_step()
    opt = hvd.DistributedOptimizer(v1.train.AdamOptimizer(0.05))
    train = opt.minimize(loss, global_step=step)
    return x, y, loss, train


def batches():
    lo = hvd.rank() * BATCH // hvd.size()
    hi = (hvd.rank() + 1) * BATCH // hvd.size()
    for start in range(0, len(X), BATCH):
        yield X[start:start + BATCH][lo:hi], Y[start:start + BATCH][lo:hi]


def values():
    return {v.name: v1.get_default_session().run(v).tolist() for v in v1.global_variables()}


result = {}
with tf.Graph().as_default():
    x, y, loss, train = build()
    mean_loss = hvd.allreduce(loss)   # for logging, as Horovod scripts do
    losses = []
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(0))   # alone, nothing fed
        for _ in range(2):
            for xs, ys in batches():
                losses.append(float(sess.run([mean_loss, train], {x: xs, y: ys})[0]))
        result["session"] = {"losses": losses, "variables": values()}

with tf.Graph().as_default():
    x, y, loss, train = build()
    final = v1.train.FinalOpsHook({v.name: v for v in v1.global_variables()})
    hooks = [hvd.BroadcastGlobalVariablesHook(0), v1.train.StopAtStepHook(last_step=8), final]
    losses = []
    with v1.train.MonitoredTrainingSession(hooks=hooks) as mon:
        feeds = iter(list(batches()) * 2)
        while not mon.should_stop():
            xs, ys = next(feeds)
            losses.append(float(mon.run([loss, train], {x: xs, y: ys})[0]))
    result["monitored"] = {"losses": losses, "variables": {
        name: value.tolist() for name, value in final.final_ops_values.items()}}

with open("%s.%d" % (sys.argv[1], hvd.rank()), "w") as f:
    json.dump(result, f)
print("done", result["session"]["losses"][-1])
