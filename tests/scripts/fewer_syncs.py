"""Test script: delay=1, LocalSGD and DiLoCo against their references, on every rank.

Usage: fewer_syncs.py OUT. Runs every check in one process per rank (one
TensorFlow start-up) and writes OUT.<rank> (JSON): per check, the largest
difference to its reference and whether the weights were bitwise equal
across ranks where they must be. The test asserts on it.

Data: STEPS global batches of GLOBAL rows; rank r trains on its contiguous
slice of each (rows r*b..(r+1)*b). Model: 6 -> 16 (relu) -> 2, weights fixed
by a seed on every rank.
"""

import hashlib
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import matex

out = sys.argv[1]
rank, size = matex.rank(), matex.size()
STEPS, GLOBAL, LR = 6, 12, 0.1
b = GLOBAL // size
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS * GLOBAL, 6)).astype("float32")
Y = (X[:, :3].sum(1) > X[:, 3:].sum(1)).astype("int64")
batches = [(X[t * GLOBAL:(t + 1) * GLOBAL], Y[t * GLOBAL:(t + 1) * GLOBAL]) for t in range(STEPS)]
mine = [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]) for x, y in batches]
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
control = matex._runtime.control()
results = {}


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2)])


def weights(m):
    return [v.numpy() for v in m.trainable_variables]


def same_everywhere(m):
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(m))).hexdigest()
    return len(set(control.allgather(digest))) == 1


def gap(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


losses = tf.Variable(0.0)


def custom_loop(optimizer, each_step=None, blocking_too=False):
    m = model()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        if blocking_too:   # a blocking allreduce on the data communicator, while the
            # previous step's non-blocking one is still outstanding
            losses.assign_add(matex.allreduce(loss, "sum"))
        grads = tape.gradient(loss, m.trainable_variables)
        optimizer.apply(grads, m.trainable_variables)

    for t, (x, y) in enumerate(mine):
        step(x, y)
        if each_step is not None:
            each_step(t, m)
    return m


def fit(optimizer, callbacks=()):
    m = model()
    m.compile(optimizer=optimizer, loss=loss_fn)
    x = np.concatenate([x for x, _ in mine])
    y = np.concatenate([y for _, y in mine])
    m.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))
    return m


def delayed_reference(momentum, flush):
    """One process, the global batch: the gradient of step t applied at step t+1."""
    m = model()
    opt = keras.optimizers.SGD(LR, momentum=momentum)
    opt.build(m.trainable_variables)
    history, pending = [], None
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        grads = tape.gradient(loss, m.trainable_variables)
        if pending is None:
            opt.iterations.assign_add(1)   # step 0 applies nothing, the counter advances
        else:
            opt.apply(pending, m.trainable_variables)
        pending = grads
        history.append(weights(m))
    if flush:
        opt.apply(pending, m.trainable_variables)
        history.append(weights(m))
    return history


# ---- bad input: every rank raises the same clear error ----------------------
errors = []
for make in (lambda: matex.LocalSGD(keras.optimizers.SGD(), sync_every=0),
             lambda: matex.LocalSGD(keras.optimizers.SGD(), sync_every=1.5),
             lambda: matex.DiLoCo(keras.optimizers.SGD(), keras.optimizers.SGD(), sync_every=-2),
             lambda: matex.DistributedOptimizer(keras.optimizers.SGD(), delay=2),
             lambda: matex.DistributedOptimizer(keras.optimizers.SGD(), delay=True)):
    try:
        make()
        errors.append(None)
    except ValueError as exc:
        errors.append(str(exc))
results["errors"] = errors


# ---- options that would be ignored are errors, on every rank ----------------
def option_error(make):
    try:
        make()
        return None
    except ValueError as exc:
        return str(exc)


def with_env_compression(make):
    import os

    os.environ["MATEX_COMPRESSION"] = "topk:0.1"
    try:
        return option_error(make)
    finally:
        del os.environ["MATEX_COMPRESSION"]


summed = matex.DistributedOptimizer(keras.optimizers.SGD(), op="sum")
results["option_errors"] = [
    option_error(lambda: matex.DistributedOptimizer(summed, op="average")),
    option_error(lambda: matex.DistributedOptimizer(summed, delay=1)),
    option_error(lambda: matex.DistributedOptimizer(summed, fusion_threshold=123)),
    option_error(lambda: matex.DistributedOptimizer(summed, compression="fp16")),
    with_env_compression(lambda: matex.DistributedOptimizer(keras.optimizers.SGD(), delay=1)),
    with_env_compression(lambda: matex.LocalSGD(keras.optimizers.SGD(), sync_every=2)),
    with_env_compression(lambda: matex.DiLoCo(keras.optimizers.SGD(), keras.optimizers.SGD(),
                                              sync_every=2)),
    option_error(lambda: matex.LocalSGD(matex.DistributedOptimizer(
        keras.optimizers.SGD(), compression="fp16"), sync_every=2)),
]
# what compile does under matex.keras: the same call with no settings keeps them
results["option_kept"] = (matex.DistributedOptimizer(summed) is summed
                          and summed._matex.op == "sum")

# ---- data parallel references -------------------------------------------------
dp = weights(custom_loop(matex.DistributedOptimizer(keras.optimizers.SGD(LR))))
dp_momentum = weights(custom_loop(matex.DistributedOptimizer(
    keras.optimizers.SGD(LR, momentum=0.9))))

# ---- Local SGD, sync_every=1 == data parallel (custom loop and fit) -----------
results["localsgd1_loop"] = gap(weights(custom_loop(
    matex.LocalSGD(keras.optimizers.SGD(LR), sync_every=1))), dp)
results["localsgd1_momentum_loop"] = gap(weights(custom_loop(
    matex.LocalSGD(keras.optimizers.SGD(LR, momentum=0.9), sync_every=1))), dp_momentum)
results["localsgd1_fit"] = gap(weights(fit(
    matex.LocalSGD(keras.optimizers.SGD(LR), sync_every=1))), dp)

# ---- uneven slices (8 and 4 rows of each 12-row global batch, as fit divides a batch
# that does not divide evenly): Local SGD and DiLoCo weight each rank's weights by its
# rows, so sync_every=1 with SGD is still data parallelism (which weights gradients) ----
def uneven_loop(optimizer, rows_known=True):
    m = model()
    # rank r gets (size - r) shares of the batch: 2 ranks 8 and 4 rows, 3 ranks 6, 4, 2
    ends = [GLOBAL - GLOBAL * (size - r) * (size - r + 1) // (size * (size + 1))
            for r in range(size + 1)]
    lo, hi = ends[rank], ends[rank + 1]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        grads = tape.gradient(loss, m.trainable_variables)
        if rows_known:   # as fit tells the optimizer
            with matex._optimizer.rows_of_step(optimizer, (x,)):
                optimizer.apply(grads, m.trainable_variables)
        else:
            optimizer.apply(grads, m.trainable_variables)

    for x, y in batches:
        step(x[lo:hi], y[lo:hi])
    return m


uneven_dp = weights(uneven_loop(matex.DistributedOptimizer(keras.optimizers.SGD(LR))))
results["uneven_localsgd1"] = gap(weights(uneven_loop(
    matex.LocalSGD(keras.optimizers.SGD(LR), sync_every=1))), uneven_dp)
results["uneven_diloco1"] = gap(weights(uneven_loop(matex.DiLoCo(
    keras.optimizers.SGD(LR), keras.optimizers.SGD(1.0), sync_every=1))), uneven_dp)
# the plain mean of the weights (rows unknown): what Local SGD did before
results["uneven_localsgd1_plain_mean"] = gap(weights(uneven_loop(
    matex.LocalSGD(keras.optimizers.SGD(LR), sync_every=1), rows_known=False)), uneven_dp)

# ---- Local SGD, sync_every=3: apart between syncs, bitwise equal at them -----
equal_at = []
matex._stats.reset()
local3 = weights(custom_loop(matex.LocalSGD(keras.optimizers.SGD(LR), sync_every=3),
                             lambda t, m: equal_at.append(same_everywhere(m))))
results["localsgd3_equal_after_step"] = equal_at
results["stats_localsgd3"] = matex.stats()

# ---- DiLoCo with outer SGD(1.0) == Local SGD (custom loop and fit) -----------
matex._stats.reset()
results["diloco_vs_localsgd_loop"] = gap(weights(custom_loop(matex.DiLoCo(
    keras.optimizers.SGD(LR), keras.optimizers.SGD(1.0), sync_every=3))), local3)
results["stats_diloco3"] = matex.stats()
fit_local = weights(fit(matex.LocalSGD(keras.optimizers.SGD(LR), sync_every=3)))
results["localsgd3_fit_vs_loop"] = gap(fit_local, local3)
results["diloco_vs_localsgd_fit"] = gap(weights(fit(matex.DiLoCo(
    keras.optimizers.SGD(LR), keras.optimizers.SGD(1.0), sync_every=3))), fit_local)
# a real outer optimizer moves elsewhere, identically on every rank
nesterov = custom_loop(matex.DiLoCo(keras.optimizers.SGD(LR),
                                    keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
                                    sync_every=3))
results["diloco_nesterov_vs_localsgd"] = gap(weights(nesterov), local3)
results["diloco_nesterov_equal"] = same_everywhere(nesterov)

# ---- delay=1: the analytically delayed reference, bitwise equal every step ---
for momentum in (0.0, 0.9):
    reference = delayed_reference(momentum, flush=True)
    gaps, equal = [], []

    def check(t, m):
        gaps.append(gap(weights(m), reference[t]))
        equal.append(same_everywhere(m))

    opt = matex.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=momentum), delay=1)
    losses.assign(0.0)
    matex._stats.reset()
    m = custom_loop(opt, check, blocking_too=True)
    results["stats_delay_%s" % momentum] = matex.stats()
    results["delay_blocking_losses_%s" % momentum] = float(losses.numpy())
    results["delay_vs_undelayed_%s" % momentum] = gap(
        weights(m), dp_momentum if momentum else dp)
    results["delay_pending_before_flush_%s" % momentum] = bool(
        opt._matex.strategy.pending())
    results["delay_flushed_%s" % momentum] = matex.flush(opt)
    check(STEPS, m)
    results["delay_flush_again_%s" % momentum] = matex.flush(opt)
    results["delay_loop_gaps_%s" % momentum] = gaps
    results["delay_loop_equal_%s" % momentum] = equal


class EveryStep(keras.callbacks.Callback):
    def __init__(self, reference):
        super().__init__()
        self.reference, self.gaps, self.equal = reference, [], []

    def on_train_batch_end(self, batch, logs=None):
        self.gaps.append(gap(weights(self.model), self.reference[batch]))
        self.equal.append(same_everywhere(self.model))


every = EveryStep(delayed_reference(0.9, flush=False))
fit(matex.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9), delay=1), [every])
results["delay_fit_gaps"] = every.gaps
results["delay_fit_equal"] = every.equal
# nothing left in flight after the flushes but the fit's last gradient
results["pending_requests"] = int(matex._collectives._ops().matex_iallreduce_pending())

with open("%s.%d" % (out, rank), "w") as f:
    json.dump(results, f)
