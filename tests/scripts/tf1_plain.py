"""A plain TF1 Session script, with no MaTEx or Horovod call (tests/test_legacy_tf1.py).

``python tf1_plain.py OUT [raise]``: three models over the same placeholders,
trained in one Session loop by three optimizer shapes:

- GradientDescent through ``minimize(loss, global_step=)``;
- Adam through ``compute_gradients``, ``clip_by_global_norm``, ``apply_gradients``;
- Momentum through the script's own ``tf.gradients`` and ``apply_gradients``;

on shuffled mini-batches of 7 rows (3 ranks get 2, 2 and 3 rows) with a fed
scalar learning rate, then an evaluation run over all rows. The process's
rank (OMPI_COMM_WORLD_RANK, 0 alone) only offsets the initial values (rank 0's
are one process's) and names the result file OUT.<rank>; with ``raise`` rank 1
feeds a wrong shape at step 3 (an error inside Session.run on one rank), with
``kill`` it kills itself (SIGKILL) there.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_v2_behavior()
v1 = tf.compat.v1

out = sys.argv[1]
fail = sys.argv[2:3]   # ["raise"] or ["kill"]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))

rng = np.random.RandomState(0)
X = rng.rand(28, 4).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
     + 0.1 * rng.randn(28, 1).astype(np.float32))

x = v1.placeholder(tf.float32, [None, 4], name="x")
y = v1.placeholder(tf.float32, [None, 1], name="y")
lr = v1.placeholder(tf.float32, [], name="lr")


def model(name, seed):
    init = np.random.RandomState(seed)
    with v1.variable_scope(name):
        w1 = v1.get_variable("w1", initializer=init.randn(4, 3).astype(np.float32) + rank)
        b1 = v1.get_variable("b1", initializer=np.zeros(3, np.float32) + rank)
        w2 = v1.get_variable("w2", initializer=init.randn(3, 1).astype(np.float32) - rank)
    hidden = tf.tanh(tf.matmul(x, w1) + b1)
    return tf.reduce_mean(tf.square(tf.matmul(hidden, w2) - y)), [w1, b1, w2]


loss_gd, _ = model("gd", 1)
loss_adam, vars_adam = model("adam", 2)
loss_mom, vars_mom = model("momentum", 3)

step = v1.train.get_or_create_global_step()
train_gd = v1.train.GradientDescentOptimizer(lr).minimize(loss_gd, global_step=step)
adam = v1.train.AdamOptimizer(0.05)
pairs = adam.compute_gradients(loss_adam, var_list=vars_adam)
clipped, _ = tf.clip_by_global_norm([g for g, _ in pairs], 1.0)
train_adam = adam.apply_gradients(zip(clipped, vars_adam))
# tf.tuple: every gradient is computed before any update reads it (without it one process
# races: w2's update may land before w1's gradient reads w2)
grads = tf.tuple(tf.gradients(loss_mom, vars_mom))
train_mom = v1.train.MomentumOptimizer(0.05, 0.9).apply_gradients(zip(grads, vars_mom))

losses = []
with v1.Session() as sess:
    sess.run(v1.global_variables_initializer())
    order = np.random.RandomState(1)
    for epoch in range(3):
        perm = order.permutation(len(X))
        for start in range(0, len(X), 7):
            rows = perm[start:start + 7]
            xs = X[rows]
            if fail and rank == 1 and epoch == 0 and start == 21:
                if fail == ["kill"]:
                    os.kill(os.getpid(), 9)
                xs = xs[:, :3]
            values = sess.run([loss_gd, loss_adam, loss_mom, train_gd, train_adam, train_mom],
                              {x: xs, y: Y[rows], lr: 0.1})
            losses.append([float(v) for v in values[:3]])
    evaluation = sess.run([loss_gd, loss_adam, loss_mom], {x: X, y: Y})
    variables = {v.name: sess.run(v).tolist() for v in v1.global_variables()}

with open("%s.%d" % (out, rank), "w") as f:
    json.dump({"losses": losses, "evaluation": [float(e) for e in evaluation],
               "variables": variables}, f)
print("trained: evaluation losses", evaluation)
