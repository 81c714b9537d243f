"""Test script: a custom GradientTape loop under matex.run_resilient.

Usage: ft_custom_loop.py OUT N_SAMPLES BATCH EPOCHS [collectives]. Step i takes
global batch i % steps of a per-epoch permutation and keeps this rank's slice of it,
as seen at call time (so a redone step is re-divided among the survivors).

``collectives``: each step first runs the collectives added for Horovod's API
(alltoall with splits, reducescatter, Adasum, grouped_allgather, broadcast_object,
allgather_object, barrier, the should_commit vote) and checks each result against
NumPy for the ranks alive then; the report lists every mismatch.
``FT_KILL_BEFORE="WORLD_RANK:STEP:NAME,..."`` kills that rank right before that
collective at that step, so the survivors meet the failure inside it.
"""

import json
import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

import matex

out, n, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
collectives = sys.argv[5:6] == ["collectives"]
steps = -(-n // batch)
rng = np.random.default_rng(0)
x = rng.normal(size=(n, 6)).astype("float32")
y = (x[:, :3].sum(1) > x[:, 3:].sum(1)).astype("int64")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2)])
# gradients weighted by each rank's share of the global batch, then summed
optimizer = matex.DistributedOptimizer(keras.optimizers.Adam(0.01), op="sum")
seen = tf.Variable(tf.zeros([n]))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train(xb, yb, ids, rows):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    seen.assign_add(matex.allreduce(tf.math.bincount(ids, minlength=n, maxlength=n,
                                                     dtype=tf.float32), "sum"))
    grads = tape.gradient(loss, model.trainable_variables)
    weight = tf.cast(rows, tf.float32) / matex.allreduce(tf.cast(rows, tf.float32), "sum")
    optimizer.apply([g * weight for g in grads], model.trainable_variables)


KILLS = {(int(r), int(s)): name for r, s, name in
         (k.split(":") for k in os.environ.get("FT_KILL_BEFORE", "").split(",") if k)}
mismatches = []


def _before(i, name):
    from mpi4py import MPI

    if KILLS.get((MPI.COMM_WORLD.Get_rank(), i)) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _expect(i, name, got, want):
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        mismatches.append("step %d size %d %s: %r != %r" % (i, matex.size(), name, got, want))


def check_collectives(i):
    """Each collective against NumPy over the ranks alive now (values from i, rank, size)."""
    r, size = matex.rank(), matex.size()
    _before(i, "alltoall")
    rows = np.concatenate([np.full([j + 1, 2], 100 * r + j + i, np.int32) for j in range(size)])
    out, received = matex.alltoall(rows, splits=[j + 1 for j in range(size)])
    _expect(i, "alltoall", out.numpy(), np.concatenate(
        [np.full([r + 1, 2], 100 * k + r + i, np.int32) for k in range(size)]))
    _expect(i, "alltoall splits", received.numpy(), [r + 1] * size)
    _before(i, "reducescatter")
    part = matex.reducescatter(np.arange(2 * size, dtype=np.float32) * (r + 1 + i), op="sum")
    total = sum(k + 1 + i for k in range(size))
    _expect(i, "reducescatter", part.numpy(), np.arange(2 * r, 2 * r + 2) * total)
    _before(i, "adasum")   # orthogonal vectors: their adaptive sum is their sum
    _expect(i, "adasum", matex.allreduce(np.eye(4, dtype=np.float32)[r] * (r + 1 + i),
                                         op="adasum").numpy(),
            [k + 1 + i if k < size else 0 for k in range(4)])
    _before(i, "grouped_allgather")
    a, b = matex.grouped_allgather([np.full([r + 1], r + i, np.int64),
                                    np.full([1, 3], r * i, np.float32)])
    _expect(i, "grouped_allgather", a.numpy(), np.repeat(np.arange(size) + i, np.arange(size) + 1))
    _expect(i, "grouped_allgather 2", b.numpy(), np.arange(size)[:, None].repeat(3, 1) * i)
    _before(i, "broadcast_object")
    _expect(i, "broadcast_object", matex.broadcast_object({"step": i, "rank": r})["rank"], 0)
    _before(i, "allgather_object")
    _expect(i, "allgather_object", matex.allgather_object((r, i)), [(k, i) for k in range(size)])
    _before(i, "barrier")
    _expect(i, "barrier", int(matex.barrier()), size)
    _before(i, "should_commit")   # the vote: True only if every rank says so
    _expect(i, "should_commit", [matex.should_commit(True), matex.should_commit(r != size - 1)],
            [True, False])


def step(i):
    if collectives:
        check_collectives(i)
    order = np.random.default_rng([7, i // steps]).permutation(n)
    idx = order[(i % steps) * batch:(i % steps + 1) * batch]
    lo, hi = len(idx) * matex.rank() // matex.size(), len(idx) * (matex.rank() + 1) // matex.size()
    mine = idx[lo:hi]
    train(x[mine], y[mine], tf.constant(mine, tf.int32), len(mine))


optimizer.build(model.trainable_variables)
recoveries = matex.run_resilient(step, steps * epochs, model.variables + optimizer.variables,
                                 optimizer, undo_on_redo=[seen])
from matex import _resilience  # noqa: E402
from mpi4py import MPI  # noqa: E402

with open("%s.%d" % (out, MPI.COMM_WORLD.Get_rank()), "w") as f:
    json.dump({"seen": seen.numpy().tolist(), "size": matex.size(), "recoveries": recoveries,
               "iterations": int(optimizer.iterations),
               "digest": _resilience.digest([v.numpy() for v in model.variables]),
               "mismatches": mismatches}, f)
