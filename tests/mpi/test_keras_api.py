"""Public Keras-facing API under mpiexec: callbacks, shard, weight loading, weak scaling."""

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import matex
import matex.keras as mkeras  # noqa: F401 - installs the Keras patches
from matex.callbacks import (BroadcastGlobalVariablesCallback, LearningRateWarmupCallback,
                             MetricAverageCallback)
from helpers import all_equal_bytes, gather

R, N = matex.rank(), matex.size()


def model(seed):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                          keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    return m


def test_matex_keras_reexports_keras():
    import matex.keras.layers as layers_module

    assert mkeras.layers is keras.layers and layers_module is keras.layers
    assert mkeras.Sequential is keras.Sequential and mkeras.__version__ == keras.__version__
    from matex.keras import optimizers

    assert optimizers.Adam is keras.optimizers.Adam


def test_broadcast_callback_syncs_non_trainable_variables():
    m = model(seed=10 + R)
    cb = BroadcastGlobalVariablesCallback(0)
    cb.set_model(m)
    m.layers[1].moving_mean.assign(np.full(4, float(R), np.float32))
    cb.on_train_begin()
    assert all_equal_bytes([v.numpy() for v in m.variables])
    np.testing.assert_array_equal(m.layers[1].moving_mean.numpy(), np.zeros(4))


def test_metric_average_callback_averages_logs():
    cb = MetricAverageCallback()
    logs = {"loss": float(R), "acc": 2.0 * R}
    cb.on_epoch_end(0, logs)
    assert logs == {"loss": (N - 1) / 2, "acc": float(N - 1)}


def test_warmup_ramps_to_multiplier_times_base():
    m = model(seed=1)
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    cb = LearningRateWarmupCallback(warmup_epochs=1, multiplier=4, steps_per_epoch=10)
    cb.set_model(m)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    first = float(m.optimizer.learning_rate)
    cb.on_train_batch_begin(9)
    last = float(m.optimizer.learning_rate)
    np.testing.assert_allclose([first, last], [0.1 * (1 + 3 * 0.1), 0.4], rtol=1e-6)
    # a second warmup (another fit) starts from the script's rate, not the scaled one
    again = LearningRateWarmupCallback(warmup_epochs=1, multiplier=4, steps_per_epoch=10)
    again.set_model(m)
    again.on_train_begin()
    again.on_epoch_begin(0)
    again.on_train_batch_begin(9)
    np.testing.assert_allclose(float(m.optimizer.learning_rate), 0.4, rtol=1e-6)
    # ... unless the script set another rate since
    m.optimizer.learning_rate = 0.05
    again.on_train_begin()
    again.on_train_batch_begin(9)
    np.testing.assert_allclose(float(m.optimizer.learning_rate), 0.2, rtol=1e-6)


def test_shard_slices_every_global_batch():
    ds = tf.data.Dataset.range(23).batch(6)          # batches of 6,6,6,5
    mine = [b.numpy().tolist() for b in matex.shard(ds)]
    everyone = gather(mine)
    assert len(mine) == 4                               # same step count everywhere
    rebuilt = [sum((everyone[r][k] for r in range(N)), []) for k in range(4)]
    assert rebuilt == [list(range(i, min(i + 6, 23))) for i in range(0, 23, 6)]
    assert matex.shard(matex.shard(ds)) is not None
    already = matex.shard(ds)
    assert matex.shard(already) is already             # never sharded twice


def test_load_weights_reads_on_rank0_and_broadcasts():
    m = model(seed=20 + R)
    path = os.path.join(tempfile.gettempdir(), "matex-test-%d.weights.h5" % os.getppid())
    if R == 0:
        m.save_weights(path)
        saved = [w.copy() for w in m.get_weights()]
    other = model(seed=40 + R)
    matex.comm().Barrier()
    other.load_weights(path)
    root = gather([w for w in other.get_weights()])[0]
    for a, b in zip(other.get_weights(), root):
        np.testing.assert_array_equal(a, b)
    if R == 0:
        for a, b in zip(other.get_weights(), saved):
            np.testing.assert_array_equal(a, b)
        os.remove(path)
    # rank 0 failing to read fails every rank (none waits in the broadcast)
    with pytest.raises(Exception, match="matex-test-missing"):
        other.load_weights(path.replace("matex-test-", "matex-test-missing-"))


class _LearningRates(keras.callbacks.Callback):
    """The optimizer's learning rate at every step."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate))


@pytest.mark.parametrize("how", ["keyword", "MATEX_SCALING"])
def test_weak_scaling_keeps_per_rank_batch_and_scales_learning_rate(how, monkeypatch):
    m = model(seed=3)
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    weak = {"scaling": "weak"}
    if how == "MATEX_SCALING":
        monkeypatch.setenv("MATEX_SCALING", "weak")
        weak = {}
    steps = -(-64 // (8 * N))                     # the batch of 8 is per rank
    for repeat in (1, 2):                         # a second fit must not compound
        rates = _LearningRates()
        history = m.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[rates], **weak)
        assert len(history.history["loss"]) == 2
        assert int(m.optimizer.iterations) == 2 * steps * repeat
        # linear warmup over the first epoch to N times the script's rate
        expected = [0.01 * (1 + (N - 1) * min(1.0, (i + 1) / steps)) for i in range(2 * steps)]
        np.testing.assert_allclose(rates.rates, expected, rtol=1e-6)
        # the script's own rate once fit returns
        np.testing.assert_allclose(float(m.optimizer.learning_rate), 0.01, rtol=1e-6)
    # BatchNormalization's moving statistics included: averaged over ranks
    assert all_equal_bytes([v.numpy() for v in m.variables])
    with pytest.raises(ValueError, match="scaling must be"):
        m.fit(x, y, scaling="medium")


def test_weak_scaling_refuses_a_learning_rate_schedule():
    m = model(seed=4)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=10, decay_rate=0.9)
    m.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    x = np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    with pytest.raises(ValueError, match="settable learning rate.*ExponentialDecay"):
        m.fit(x, y, batch_size=8, epochs=1, verbose=0, scaling="weak")
    assert int(m.optimizer.iterations) == 0
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)   # strong scaling: the schedule as is
    assert int(m.optimizer.iterations) == 4


class _ScriptsOwnLogger(keras.callbacks.CSVLogger):
    """A user's subclass of a writer: still a writer (filtered by type, not by name)."""


def test_only_rank0_writes_files_and_shows_progress(capsys):
    # Each rank's script writes under its own directory: whatever appears in
    # r1/ was written by rank 1.
    import shutil

    base = matex.comm().bcast(tempfile.mkdtemp(prefix="matex-writers-") if R == 0 else None,
                              root=0)
    mine = os.path.join(base, "r%d" % R)
    os.makedirs(mine)
    m = model(seed=5)
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = np.random.default_rng(2).normal(size=(48, 3)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    callbacks = [
        keras.callbacks.TensorBoard(os.path.join(mine, "logs")),
        keras.callbacks.BackupAndRestore(os.path.join(mine, "backup"), delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(os.path.join(mine, "best.weights.h5"),
                                        save_weights_only=True),
        _ScriptsOwnLogger(os.path.join(mine, "log.csv")),
    ]
    m.fit(x, y, batch_size=8, epochs=2, validation_split=0.25, verbose=1, callbacks=callbacks)
    m.save_weights(os.path.join(mine, "final.weights.h5"))
    m.save(os.path.join(mine, "final.keras"))
    printed = gather(capsys.readouterr().out)
    written = gather({os.path.relpath(d, mine): sorted(f) for d, _, f in os.walk(mine)})
    # Only rank 0's disk holds the backup: every rank resumes from it, in step
    resumed = model(seed=60 + R)
    resumed.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = resumed.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(os.path.join(mine, "backup"), delete_checkpoint=False)])
    resumed_epochs = gather(history.epoch)
    assert all_equal_bytes([v.numpy() for v in resumed.variables])
    matex.comm().Barrier()
    if R == 0:
        shutil.rmtree(base)
    root = written[0]
    assert root["."] == ["best.weights.h5", "final.keras", "final.weights.h5", "log.csv"]
    assert root["backup"] == ["latest.weights.h5", "training_metadata.json"]
    for run in ("train", "validation"):
        events = root[os.path.join("logs", run)]
        assert len(events) == 1 and events[0].startswith("events.out.tfevents"), events
    assert written[1:] == [{".": []}] * (N - 1)
    assert "Epoch 2/2" in printed[0] and "\u2501" in printed[0]    # rank 0's progress bar
    assert printed[1:] == [""] * (N - 1)
    assert resumed_epochs == [[2]] * N


def test_batchnorm_moving_statistics_are_the_single_process_ones():
    # Learning rate 0: the layers feeding BatchNormalization stay fixed, so the
    # one-process moving mean follows from the global batches' means alone.
    m = model(seed=5)
    m.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    batch = 4 * N                                    # the global batch, equal slices
    x = np.random.default_rng(2).normal(size=(6 * batch, 3)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    dense, norm = m.layers[0], m.layers[1]
    m.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    h = x @ dense.kernel.numpy() + dense.bias.numpy()
    mean, var = np.zeros(4), np.ones(4)
    for _ in range(2):
        for b in range(6):
            rows = h[b * batch:(b + 1) * batch]
            mean = norm.momentum * mean + (1 - norm.momentum) * rows.mean(0)
            slices = np.split(rows, N)                 # variance: mean of the slices' variances
            var = norm.momentum * var + (1 - norm.momentum) * np.mean([s.var(0) for s in slices], 0)
    np.testing.assert_allclose(norm.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.moving_variance.numpy(), var, rtol=1e-5, atol=1e-6)
    assert all_equal_bytes([v.numpy() for v in m.variables])


def test_step_snapshot_restores_small_and_large_non_trainable_state():
    # What fit keeps per step under ULFM, to redo a step a failure interrupted:
    # copies of small variables, copy-on-write reads of large ones.
    from matex import _recovery

    m = model(seed=7)
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    m.build((None, 3))
    m.optimizer.build(m.trainable_variables)
    big = keras.Variable(np.arange(1 << 17, dtype=np.float32), trainable=False)   # 512 KB
    small = keras.Variable(np.ones(4, np.float32), trainable=False)
    m.layers[1]._tracker.unlock()
    m.layers[1].extra = [big, small]
    state = _recovery.model_state(m)
    state.begin_step()
    before = [v.numpy().copy() for v in m.non_trainable_variables]
    assert any(v is big for v in m.non_trainable_variables)
    big.assign_add(np.ones(1 << 17, np.float32))
    small.assign(np.zeros(4, np.float32))
    for v in m.non_trainable_variables:
        v.assign(v + 1.0)
    state.restore()
    for v, want in zip(m.non_trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), want)


@pytest.mark.parametrize("wrapped_by", ["compile", "script"])
def test_mixed_precision_reduces_gradients_once_per_step(monkeypatch, wrapped_by):
    # compile wraps Keras's LossScaleOptimizer; its inner optimizer applies the
    # already reduced gradients (a second reduction would double the traffic).
    from matex import _fusion

    metrics_threshold = 1 << 30   # get_metrics_result's reductions: not gradients
    reductions = []
    original = _fusion.allreduce_gradients

    def counting(grads, op="average", threshold=None, names=None):
        if threshold != metrics_threshold:
            reductions.append(len(grads))
        return original(grads, op, threshold, names)

    monkeypatch.setattr(_fusion, "allreduce_gradients", counting)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(11)
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dense(1, dtype="float32")])
        optimizer = keras.optimizers.SGD(0.1)
        if wrapped_by == "script":   # the script distributes the inner optimizer itself
            optimizer = matex.DistributedOptimizer(optimizer)
        m.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
        assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        # 16 global rows (compile: MaTEx shards them), or 16 rows of each rank's
        # own (explicit use): 2 steps either way
        seed = 4 if wrapped_by == "compile" else 40 + R
        x = np.random.default_rng(seed).normal(size=(16, 3)).astype(np.float32)
        m.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=1, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # 2 steps, 4 gradients each, once; compile's fit weights them by the rows, whose
    # count rides in the same fused allreduce (no commit vote: the loss scale decides)
    expected = 4 + (wrapped_by == "compile")
    assert reductions == [expected, expected], reductions
    assert all_equal_bytes([v.numpy() for v in m.variables])


def _covered(barrier):
    """The ops a barrier (a group: NoOps over control inputs) stands for."""
    seen, out, todo = set(), [], [barrier]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type == "NoOp":
            todo.extend(op.control_inputs)
        else:
            out.append(op)
    return out


@pytest.mark.parametrize("kind", ["plain", "delay", "localsgd"])
def test_every_update_commits_through_the_commit_point(kind, monkeypatch):
    """One commit point (``matex._commit``) makes every optimizer's update all-or-nothing:
    once per apply, the update is the graph's barrier, and a collective created after it
    (the next step's, a metric's) waits for the whole update, the step counter's increment
    included. Only traced, not run."""
    from matex import _collectives, _commit

    keras.utils.set_random_seed(3)
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    opt = {"plain": lambda: matex.DistributedOptimizer(keras.optimizers.SGD(0.1)),
           "delay": lambda: matex.DistributedOptimizer(keras.optimizers.SGD(0.1), delay=1),
           "localsgd": lambda: matex.LocalSGD(keras.optimizers.SGD(0.1), sync_every=2)}[kind]()
    opt.build(layer.trainable_variables)
    barriers, real = [], _commit.commit

    def spy(update, after=()):
        result = real(update, after)
        graph = tf.compat.v1.get_default_graph()
        barriers.append((graph, _collectives._barriers.get(graph)))
        return result

    monkeypatch.setattr(_commit, "commit", spy)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        opt.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
        return matex.allreduce(loss, "sum")

    graph = step.get_concrete_function(tf.TensorSpec([4, 3], tf.float32)).graph
    barriers = [b for g, b in barriers if g is graph]   # (tf.function may trace twice)
    assert len(barriers) == 1 and barriers[0] is not None, barriers
    barrier = barriers[0]
    later = [op for op in graph.get_operations() if op.type == "MatexAllreduce"][-1]
    assert barrier in later.control_inputs
    covered = _covered(barrier)
    types = {op.type for op in covered}
    if kind == "plain":
        # the weights' update and the step counter's increment (Keras gives it no data
        # dependency on the gradients: only the commit point puts it in the update)
        counter = [op for op in covered if op.type == "AssignVariableOp"
                   and op.get_attr("dtype") == tf.int64]
        assert len(counter) == 1, types
        assert "AssignSubVariableOp" in types, types
    else:   # delay=1: the handles and the apply-or-skip cond; LocalSGD: the sync cond
        assert types & {"If", "StatelessIf"}, types
        if kind == "delay":
            assert "AssignVariableOp" in types, types


def test_step_states_are_those_that_joined():
    """Per-step state joins the registry where it is made (delay=1's handles, Local SGD's
    rollback, a compressor's residuals); fit and run_resilient ask it, the model's own
    state first."""
    from matex import _delayed, _recovery
    from matex.compression import TopK
    from matex.compression._base import CompressorState
    from matex.localsgd._local_sgd import RollbackState

    def kinds(optimizer):
        return [type(s) for s in _recovery.step_states(optimizer, lambda: [])]

    assert kinds(keras.optimizers.SGD()) == []
    assert kinds(matex.DistributedOptimizer(keras.optimizers.SGD())) == []
    assert kinds(matex.DistributedOptimizer(keras.optimizers.SGD(), delay=1)) == \
        [_delayed.DelayState]
    assert kinds(matex.DistributedOptimizer(keras.optimizers.SGD(),
                                            compression=TopK(0.1))) == [CompressorState]
    assert kinds(matex.LocalSGD(keras.optimizers.SGD(), sync_every=2)) == [RollbackState]
    assert kinds(matex.DiLoCo(keras.optimizers.SGD(), keras.optimizers.SGD(),
                              sync_every=2)) == [RollbackState]

    class Counter(_recovery.State):
        pass

    m = model(seed=1)
    m.compile(optimizer=matex.LocalSGD(keras.optimizers.SGD(0.1), sync_every=2), loss="mse")
    _recovery.join(m.optimizer, "counter", lambda optimizer, variables: Counter())
    states = _recovery.model_states(m)
    assert [type(s) for s in states] == [_recovery.VariablesState, RollbackState, Counter]
    assert states[1].variables is states[0].variables   # a rollback puts the model back too
    # keyed: a state registered again under its key replaces it, in its place; leave removes
    assert _recovery.joined(m.optimizer) == ["rollback", "counter"]
    _recovery.join(m.optimizer, "rollback", lambda optimizer, variables: Counter())
    assert [type(s) for s in _recovery.model_states(m)] == [_recovery.VariablesState, Counter,
                                                            Counter]
    _recovery.leave(m.optimizer, "rollback")
    _recovery.leave(m.optimizer, "absent")
    assert _recovery.joined(m.optimizer) == ["counter"]


def test_jit_compiled_fit_reports_exact_global_metrics():
    """jit_compile=True under matex.keras: the step's compute is XLA-compiled and the
    reduction is not; the metrics' global sum (no collective can run inside XLA) is done
    by the step outside. Before, fit failed: "No registered 'MatexGroupedAllreduce'
    OpKernel for XLA_CPU_JIT"."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = (x[:, :2].sum(1) > x[:, 2:].sum(1)).astype("int64")
    histories = {}
    for jit in (False, True):
        keras.utils.set_random_seed(5)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
        m.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit)
        histories[jit] = m.fit(x, y, batch_size=24, epochs=3, shuffle=False, verbose=0).history
        # exact global metrics: every rank reports the same numbers
        assert gather(histories[jit]["accuracy"]) == [histories[jit]["accuracy"]] * N
    np.testing.assert_allclose(histories[True]["accuracy"], histories[False]["accuracy"])
    np.testing.assert_allclose(histories[True]["loss"], histories[False]["loss"], rtol=1e-5)


def _frozen_classifier():
    """A classifier that learning rate 0 keeps as it is: its fit metrics are those of its
    initial weights over the data seen, so one process's values are known exactly."""
    keras.utils.set_random_seed(11)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(2)])
    m.compile(keras.optimizers.SGD(0.0),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def _frozen_data(rows):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 4)).astype("float32")
    y = (x[:, 0] > x[:, 1]).astype("int64")
    return x, y


def _one_process(m, x, y):
    """Per-sample loss and correctness of ``m`` on every row (no collective)."""
    logits = m(x, training=False).numpy().astype("float64")
    shifted = logits - logits.max(1, keepdims=True)
    loss = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(len(y)), y]
    return loss, (logits.argmax(1) == y).astype("float64")


def test_fit_makes_one_collective_per_step_with_exact_global_metrics():
    """The rows count rides in the gradients' fused allreduce and the metrics are summed
    when read (each epoch's end), so a training step makes one collective. Fits of 4 and
    8 steps per epoch differ by 4 collectives per epoch, every one a fused allreduce of
    the gradients, the rows and the commit vote; the epoch's metrics are one process's over
    the global data, on every rank. Before: 3 per step (rows, gradients, metrics)."""
    from matex import _native

    core = _native.core()
    batch = 6 * N   # the global batch: 6 rows per rank
    m = _frozen_classifier()
    m.fit(*_frozen_data(batch), batch_size=batch, epochs=1, verbose=0)   # first-step sync
    counts, histories = {}, {}
    for steps in (4, 8):
        x, y = _frozen_data(steps * batch)
        before = core.flight_sequence()
        histories[steps] = m.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                                 verbose=0).history
        counts[steps] = core.flight_sequence() - before
        fused = [e for e in core.flight_entries() if e["seq"] > before and e["kind"] == 2
                 and e["num_tensors"] == len(m.trainable_variables) + 2]
        # gradients, rows and the commit vote, per step
        assert len(fused) == 2 * steps, (steps, len(fused))
        loss, correct = _one_process(m, x, y)
        for epoch in range(2):
            np.testing.assert_allclose(histories[steps]["loss"][epoch], loss.mean(), rtol=1e-5)
            np.testing.assert_allclose(histories[steps]["accuracy"][epoch], correct.mean(),
                                       rtol=1e-6)
    assert counts[8] - counts[4] == 2 * 4, counts   # 2 epochs x 4 more steps, one each
    assert gather(histories[8]) == [histories[8]] * N
    # evaluate: no collective per step; its figures (summed at its end) one process's
    evaluated = {}
    for steps in (4, 8):
        x, y = _frozen_data(steps * batch)
        before = core.flight_sequence()
        evaluated[steps] = m.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        counts[steps] = core.flight_sequence() - before
        loss, correct = _one_process(m, x, y)
        np.testing.assert_allclose(evaluated[steps]["loss"], loss.mean(), rtol=1e-5)
        np.testing.assert_allclose(evaluated[steps]["accuracy"], correct.mean(), rtol=1e-6)
    assert counts[8] == counts[4], counts


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((logs["loss"], logs["accuracy"]))


def test_a_callback_reading_batch_logs_gets_the_global_running_metrics_every_batch():
    """A script's callback with a batch-end hook reads every batch's logs: each carries
    the running metrics over the global batches so far (one process's), on every rank,
    though the steps return local values. The progress bar's interval does not apply."""
    batch = 6 * N
    m = _frozen_classifier()
    x, y = _frozen_data(5 * batch)
    reader = _BatchLogs()
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[reader])
    loss, correct = _one_process(m, x, y)
    assert len(reader.seen) == 5
    for k, (seen_loss, seen_accuracy) in enumerate(reader.seen):
        rows = (k + 1) * batch
        np.testing.assert_allclose(seen_loss, loss[:rows].mean(), rtol=1e-5)
        np.testing.assert_allclose(seen_accuracy, correct[:rows].mean(), rtol=1e-6)
    assert gather(reader.seen) == [reader.seen] * N


def test_a_sparse_gradient_is_weighted_by_the_rows_that_ride_with_the_dense_ones():
    """An Embedding's gradient is IndexedSlices: reduced on its own, weighted by the rows
    whose count rides in the dense gradients' fused allreduce (one per step, with the
    rows). Two steps of fit equal two steps of one process on the global batches."""
    from matex import _native

    def build():
        keras.utils.set_random_seed(13)
        m = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(12, 3),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        return m

    batch = 4 * N
    rng = np.random.default_rng(17)
    x = rng.integers(0, 12, size=(2 * batch, 5)).astype("int32")
    y = rng.normal(size=(2 * batch, 1)).astype("float32")
    reference = build()   # one process: plain tape and SGD by hand on each global batch
    for k in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(x[k * batch:(k + 1) * batch])
                                            - y[k * batch:(k + 1) * batch]))
        grads = tape.gradient(loss, reference.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        for v, g in zip(reference.trainable_variables, grads):
            v.assign_sub(0.1 * tf.convert_to_tensor(g))
    m = build()
    m.compile(keras.optimizers.SGD(0.1), "mse")
    core = _native.core()
    before = core.flight_sequence()
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    fused = [e for e in core.flight_entries() if e["seq"] > before and e["kind"] == 2
             and e["num_tensors"] == 4]   # Dense kernel and bias, the rows, the vote
    assert len(fused) == 2, [(e["kind"], e["num_tensors"]) for e in core.flight_entries()
                             if e["seq"] > before]
    for got, want in zip(m.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all_equal_bytes(m.get_weights())


def _linear(seed=21):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    m.compile(keras.optimizers.SGD(0.05), "mse")
    return m


def _poisoned(batch, steps, bad_steps):
    """``steps`` global batches of ``batch`` rows; in each of ``bad_steps`` the batch's
    last row (the last rank's shard) holds a NaN feature."""
    rng = np.random.default_rng(23)
    x = rng.normal(size=(steps * batch, 3)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    for k in bad_steps:
        x[(k + 1) * batch - 1, 1] = np.nan
    return x, y


@pytest.mark.skipif(N == 1, reason="at one rank the step is plain Keras's: nothing to vote")
def test_a_step_whose_gradients_are_not_finite_on_one_rank_is_committed_on_none(capfd):
    """The commit vote rides in the gradients' fused allreduce (one collective per step
    still): the last rank's shard holds a NaN in the second global batch, so that rank
    votes against and no rank applies the step. The weights equal one process's SGD over
    the three other batches, stay finite and equal on every rank, the step counter says 3
    committed steps, and only the rank that voted against says so on its stderr.
    Before: the NaN was averaged into every rank's weights."""
    batch, steps = 4 * N, 4
    x, y = _poisoned(batch, steps, bad_steps=[1])
    m = _linear()
    reference = [w.copy() for w in m.get_weights()]
    for k in (0, 2, 3):   # one process, plain SGD on the global batches that commit
        xb, yb = x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]
        error = xb @ reference[0] + reference[1] - yb
        grad_w = 2 * xb.T @ error / batch
        grad_b = 2 * error.sum(0) / batch
        reference = [reference[0] - 0.05 * grad_w, reference[1] - 0.05 * grad_b]
    capfd.readouterr()
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    said = capfd.readouterr().err
    assert int(m.optimizer.iterations) == 3
    for got, want in zip(m.get_weights(), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(w).all() for w in m.get_weights())
    assert all_equal_bytes(m.get_weights())
    voted = "gradients hold a NaN or an infinity at step 1" in said
    assert gather(voted) == [False] * (N - 1) + [True], said


@pytest.mark.skipif(N == 1, reason="at one rank the step is plain Keras's: nothing to vote")
def test_without_the_vote_one_rank_s_nan_reaches_every_rank_s_weights(monkeypatch):
    """MATEX_COMMIT_VOTE=0 (read when the step is traced): no vote rides, every step
    commits, and the last rank's NaN is averaged into every rank's weights."""
    from matex import _native

    monkeypatch.setenv("MATEX_COMMIT_VOTE", "0")
    batch = 4 * N
    m = _linear()
    x, y = _poisoned(batch, 2, bad_steps=[1])
    core = _native.core()
    before = core.flight_sequence()
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    fused = [e["num_tensors"] for e in core.flight_entries() if e["seq"] > before
             and e["kind"] == 2]
    # per step: kernel, bias and the rows, no vote (then the epoch's metrics)
    assert fused.count(3) == 2 and 4 not in fused, fused
    assert int(m.optimizer.iterations) == 2
    assert all(np.isnan(w).all() for w in m.get_weights())


@pytest.mark.skipif(N == 1, reason="at one rank the step is plain Keras's: nothing to vote")
def test_refused_steps_in_a_row_stop_every_rank_at_the_limit(monkeypatch):
    """MATEX_SKIP_LIMIT bounds the refused steps in a row: with 2, the second refused step
    raises the same error on every rank (none left waiting); a committed step in between
    resets the count."""
    monkeypatch.setenv("MATEX_SKIP_LIMIT", "2")
    batch = 4 * N
    m = _linear()
    x, y = _poisoned(batch, 5, bad_steps=[0, 2])   # refused, committed, refused, ...
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert int(m.optimizer.iterations) == 3
    m = _linear()
    x, y = _poisoned(batch, 4, bad_steps=[1, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="steps were not committed"):
        m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert int(m.optimizer.iterations) == 1
    assert all_equal_bytes(m.get_weights())


def test_should_commit_gives_every_rank_one_answer_that_folds_in_each_rank_s_error():
    """``matex.should_commit(ok)``: True on every rank when every rank says ok, False on
    every rank when one does not. A custom loop whose last rank fails to read its second
    batch skips that step on every rank (no rank waits in a reduction the others never
    make): 3 updates each, equal weights."""
    assert gather(matex.should_commit(True)) == [True] * N
    assert gather(matex.should_commit(R != N - 1)) == [False] * N
    keras.utils.set_random_seed(5)
    layer = keras.layers.Dense(1)
    layer.build((None, 3))
    optimizer = keras.optimizers.SGD(0.1)
    matex.broadcast_variables(layer.variables, 0)
    rng = np.random.default_rng(31 + R)
    for step in range(4):
        x = rng.normal(size=(4, 3)).astype("float32")
        read = not (step == 1 and R == N - 1)   # this rank's read failed
        if not matex.should_commit(read):
            continue
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - 1.0))
        tape = matex.DistributedGradientTape(tape)
        optimizer.apply(tape.gradient(loss, layer.trainable_variables),
                        layer.trainable_variables)
    assert gather(int(optimizer.iterations)) == [3] * N
    assert all_equal_bytes([v.numpy() for v in layer.variables])


def _voting_loop(failures):
    """A ``run_resilient`` loop of 4 steps whose last rank fails to read step 1's batch
    ``failures`` times (it votes against each time). Returns (layer, optimizer, calls)."""
    keras.utils.set_random_seed(5)
    layer = keras.layers.Dense(1)
    layer.build((None, 3))
    optimizer = matex.DistributedOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(layer.trainable_variables)
    calls = []

    def step(i):
        calls.append(i)
        x = np.random.default_rng(100 * i + R).normal(size=(4, 3)).astype("float32")
        read = not (i == 1 and R == N - 1 and calls.count(1) <= failures)
        if not matex.should_commit(read):
            return
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - 1.0))
        optimizer.apply(tape.gradient(loss, layer.trainable_variables),
                        layer.trainable_variables)

    matex.run_resilient(step, 4, layer.variables + list(optimizer.variables), optimizer)
    return layer, optimizer, calls


def test_run_resilient_calls_a_refused_step_again_and_stops_every_rank_at_the_limit(
        monkeypatch):
    """A step the vote refused is called again with the same ``i`` (2 refusals: step 1
    is called 3 times, and the loop ends with 4 commits, equal weights); at
    MATEX_SKIP_LIMIT refusals in a row every rank raises, instead of calling it for ever."""
    monkeypatch.setenv("MATEX_SKIP_LIMIT", "3")
    layer, optimizer, calls = _voting_loop(failures=2)
    assert calls == [0, 1, 1, 1, 2, 3]
    assert int(optimizer.iterations) == 4
    assert all_equal_bytes([v.numpy() for v in layer.variables])
    with pytest.raises(matex.errors.MatexError, match="step 1 was called 3 times in a row"):
        _voting_loop(failures=3)


def test_nothing_keeps_a_dead_model_alive():
    """A search trains model after model in one process: once the script drops a model
    that fit, evaluated and predicted under MaTEx (its optimizer distributed, its steps
    traced, its metrics summed, its BatchNormalization synchronised), no cache of MaTEx's
    holds it, its optimizer or its variables."""
    import gc
    import weakref

    dead = []
    for trial in range(2):
        keras.utils.set_random_seed(trial)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        m.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
        x, y = _frozen_data(16 * N)
        m.fit(x, y, batch_size=4 * N, epochs=1, verbose=0)
        m.evaluate(x, y, batch_size=4 * N, verbose=0)
        m.predict(x, batch_size=4 * N, verbose=0)
        dead += [weakref.ref(m), weakref.ref(m.optimizer), weakref.ref(m.layers[0].kernel)]
        del m
    gc.collect()
    assert [r() is None for r in dead] == [True] * len(dead)


def test_a_step_traced_again_with_the_reduction_makes_matex_s_counters():
    """A tf.function step traced first without MaTEx's reduction, then with it (Horovod's
    elastic example does this): MaTEx's byte ledger is made in the second trace, where
    tf.Variable raises "Creating variables on a non-first call". (Several ranks: at one
    the tape reduces nothing.)"""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1)
    data = tf.ones([4, 3])

    @tf.function
    def step(reduce=True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(data))
        if reduce:
            tape = matex.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step(reduce=False)
    step()
    # each step: d(sum)/d(bias) = 4 rows per output, SGD 0.1 (equal data on every rank)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(), [-0.8, -0.8], rtol=1e-6)
    assert matex.stats()["steps"] >= 1


def test_clear_session_empties_matex_s_caches_and_the_next_model_trains_alike():
    """``matex.clear_session()``, the one reset: every session entry of ``matex._state``
    (byte ledgers, plans, compressors) is emptied, Keras's own state with it; the
    communicators stay, and the next model trains distributed exactly as the first."""
    from matex import _runtime, _state

    def train():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
        data = tf.fill([4, 3], float(R + 1))
        start = model.layers[0].kernel.numpy()
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(data))
            tape = matex.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        # d(sum)/d(kernel) = 4 rows of (r + 1), averaged over ranks; 2 steps of SGD 0.1
        expected = start - 2 * 0.1 * 4 * np.mean(np.arange(1, N + 1))
        np.testing.assert_allclose(model.layers[0].kernel.numpy(), expected, rtol=1e-5)
        return model.layers[0].name, model.layers[0].kernel.numpy()

    import tf_keras

    comm = _runtime.comm()
    matex.clear_session()   # earlier tests' ledgers: this test counts from nothing
    tf_keras.layers.Dense(1)   # a Keras 2 script's layer: its names restart too
    _, first = train()
    counted = matex.stats()["steps"]
    assert counted > 0
    sessions = [n for n, lifetime in _state.registered().items() if lifetime == "session"]
    assert "stats.ledgers" in sessions and len(_state.entry("stats.ledgers")) > 0
    matex.clear_session()
    for entry in map(_state.entry, sessions):
        if isinstance(entry, _state.Namespace):
            assert all(getattr(entry, k) is v for k, v in entry._defaults.items()), entry
        else:
            assert len(entry) == 0, entry
    assert matex.stats()["steps"] == 0
    assert _runtime.comm() is comm and comm.allreduce(1) == N   # process state stays
    again, second = train()
    assert again == "dense"   # Keras's names start over: its state went too
    assert tf_keras.layers.Dense(1).name == "dense"   # and tf-keras's
    assert matex.stats()["steps"] == counted   # counted anew, as from nothing
    np.testing.assert_array_equal(second, first)
    assert all_equal_bytes([second])
