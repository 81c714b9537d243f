"""Keras 2 (tf-keras, TF_USE_LEGACY_KERAS=1) under Horovod's Keras API, under mpiexec.

Launched by tests/test_legacy_keras2.py with ``TF_USE_LEGACY_KERAS=1``, so
``tf.keras`` is tf-keras here. Every check is against one process (a plain
tf-keras model trained in this process on the whole job's data) or NumPy,
and across ranks. The transparent path's refusal (``import matex.keras``) is
the last test: it patches tf-keras for the rest of the process.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import matex
import matex.horovod.tensorflow as hvd_tf
import matex.horovod.tensorflow.keras as hvd
from helpers import all_equal_bytes, gather

tf_keras = pytest.importorskip("tf_keras")
pytestmark = pytest.mark.skipif(tf.keras.__name__.split(".")[0] != "tf_keras",
                                reason="needs TF_USE_LEGACY_KERAS=1 (tf.keras is tf-keras)")

R, N = matex.rank(), matex.size()
FEATURES, ROWS, STEPS = 3, 4, 5   # rows per rank per step


def _data(seed=3):
    """x[r, k], y[r, k]: rank r's batch at step k (the same arrays on every rank)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, STEPS, ROWS, FEATURES)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3
         + 0.1 * rng.normal(size=(N, STEPS, ROWS, 1))).astype("float32")
    return x, y


def _global(a):
    """The whole job's data in one process's order: step k's global batch is every
    rank's batch k, in rank order."""
    return a.transpose(1, 0, 2, 3).reshape(-1, a.shape[-1])


def _model(offset=0.0):
    model = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh",
                                                       input_shape=(FEATURES,)),
                                 tf.keras.layers.Dense(1)])
    rng = np.random.default_rng(11)
    model.set_weights([rng.normal(size=w.shape).astype("float32") + offset
                       for w in model.get_weights()])
    return model


OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(0.05),
    "legacy_momentum": lambda: tf.keras.optimizers.legacy.SGD(lr=0.05, momentum=0.9),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "legacy_adam": lambda: tf.keras.optimizers.legacy.Adam(lr=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_with_horovod_callbacks_equals_one_process(name):
    """fit with DistributedOptimizer, the broadcast and metric callbacks and
    experimental_run_tf_function=False: every rank ends with the same weights, those
    of one process trained on the global batches from rank 0's initial weights."""
    x, y = _data()
    model = _model(offset=float(R))   # different initial weights: the callback gives rank 0's
    opt = hvd.DistributedOptimizer(OPTIMIZERS[name]())
    assert type(opt).__name__ == type(OPTIMIZERS[name]()).__name__   # Horovod keeps the name
    model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    history = model.fit(x[R].reshape(-1, FEATURES), y[R].reshape(-1, 1), batch_size=ROWS,
                        epochs=2, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
    weights = model.get_weights()
    assert all_equal_bytes(weights)
    assert all_equal_bytes(opt.variables())        # the optimizer's state too
    assert len(set(map(tuple, gather(history.history["loss"])))) == 1   # averaged logs

    reference = _model(offset=0.0)
    reference.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    reference.fit(_global(x), _global(y), batch_size=ROWS * N, epochs=2, shuffle=False,
                  verbose=0)
    for mine, ref in zip(weights, reference.get_weights()):
        np.testing.assert_allclose(mine, ref, rtol=2e-5, atol=2e-6)
    assert int(opt.iterations.numpy()) == 2 * STEPS


def test_warmup_and_schedule_callbacks_set_horovods_rates():
    """LearningRateWarmupCallback then LearningRateScheduleCallback: the logged rates are
    Horovod's formulas, equal on every rank."""
    x, y = _data()
    lr, warmup = 0.1, 2
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(lr=lr)),
                  loss="mse", experimental_run_tf_function=False)
    history = model.fit(x[R].reshape(-1, FEATURES), y[R].reshape(-1, 1), batch_size=ROWS,
                        epochs=4, shuffle=False, verbose=0, callbacks=[
                            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                            hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=warmup),
                            hvd.callbacks.LearningRateScheduleCallback(lr, 0.5, start_epoch=2)])
    expected = [lr / N * ((e + 1) * (N - 1) / warmup + 1) for e in range(warmup)]
    expected += [lr * 0.5] * 2
    np.testing.assert_allclose(history.history["lr"], expected, rtol=1e-6)
    assert all_equal_bytes(model.get_weights())


def _momentum_reference(x, y, lr, warmup, epochs, correction):
    """Legacy SGD with momentum 0.9 on the global batches under Horovod's warmup (rates
    per batch), with or without Horovod's momentum correction; float64 NumPy."""
    w, b = np.linspace(-0.5, 0.5, FEATURES).reshape(-1, 1), np.array([0.1])
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    rate = lr
    for epoch in range(epochs):
        for k in range(STEPS):
            momentum = 0.9
            if epoch < warmup:
                new = lr / N * ((epoch + k / STEPS + 1 / STEPS) * (N - 1) / warmup + 1)
                momentum = 0.9 * new / rate if correction else 0.9
                rate = new
            xb = _global(x).reshape(STEPS, -1, FEATURES)[k].astype(np.float64)
            yb = _global(y).reshape(STEPS, -1, 1)[k]
            err = xb @ w + b - yb
            gw, gb = 2 * xb.T @ err / len(xb), 2 * err.sum(0) / len(xb)
            vw, vb = momentum * vw - rate * gw, momentum * vb - rate * gb
            w, b = w + vw, b + vb
    return w, b


def test_warmup_applies_horovods_momentum_correction_to_legacy_momentum():
    """LearningRateWarmupCallback over tf.keras.optimizers.legacy.SGD(momentum=0.9):
    Horovod's momentum correction (momentum * new / old rate for the batch whose rate
    changed) is applied: the weights are NumPy's with it, not without it."""
    x, y = _data()
    lr, warmup, epochs = 0.05, 2, 3
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(FEATURES,))])
    model.set_weights([np.linspace(-0.5, 0.5, FEATURES, dtype="float32").reshape(-1, 1),
                       np.array([0.1], "float32")])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(lr=lr, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    model.fit(x[R].reshape(-1, FEATURES), y[R].reshape(-1, 1), batch_size=ROWS, epochs=epochs,
              shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=warmup)])
    w, b = model.get_weights()
    rw, rb = _momentum_reference(x, y, lr, warmup, epochs, correction=True)
    np.testing.assert_allclose(w, rw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b, rb, rtol=1e-4, atol=1e-5)
    assert float(opt.momentum) == pytest.approx(0.9)   # restored after each batch
    uw, _ = _momentum_reference(x, y, lr, warmup, epochs, correction=False)
    assert np.abs(uw - rw).max() > 1e-3   # the check can tell the two apart
    assert all_equal_bytes([w, b])


def test_custom_loop_distributed_tape_equals_one_process():
    """A tf-keras model and optimizer in a tf.function loop with hvd.DistributedGradientTape
    and hvd.broadcast_variables: the weights of one process on the global batches."""
    x, y = _data()
    model = _model(offset=float(R))
    opt = tf.keras.optimizers.SGD(0.05)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for k in range(STEPS):
        step(x[R, k], y[R, k])
    assert all_equal_bytes(model.get_weights())

    reference = _model()
    ref_opt = tf.keras.optimizers.SGD(0.05)
    for xb, yb in zip(_global(x).reshape(STEPS, -1, FEATURES), _global(y).reshape(STEPS, -1, 1)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(xb) - yb))
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables),
                                    reference.trainable_variables))
    for mine, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(mine, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("legacy", [False, True])
def test_custom_loop_distributed_optimizer_minimize(legacy):
    """opt.minimize(loss, var_list, tape=...) of a DistributedOptimizer reduces (Horovod's
    Keras 2 _compute_gradients): NumPy's linear-regression SGD on the global batches."""
    x, y = _data()
    w = tf.Variable(np.full((FEATURES, 1), 0.1 * (R + 1), "float32"))
    b = tf.Variable([0.2 * (R + 1)], dtype=tf.float32)
    hvd_tf.broadcast_variables([w, b], root_rank=0)
    base = (tf.keras.optimizers.legacy.SGD(learning_rate=0.1) if legacy
            else tf.keras.optimizers.SGD(0.1))
    opt = hvd.DistributedOptimizer(base)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(xb @ w + b - yb))
        opt.minimize(loss, [w, b], tape=tape)

    for k in range(STEPS):
        step(x[R, k], y[R, k])
    rw, rb = np.full((FEATURES, 1), 0.1), np.array([0.2])
    for xb, yb in zip(_global(x).reshape(STEPS, -1, FEATURES), _global(y).reshape(STEPS, -1, 1)):
        err = xb.astype(np.float64) @ rw + rb - yb
        rw, rb = rw - 0.1 * 2 * xb.T @ err / len(xb), rb - 0.1 * 2 * err.sum(0) / len(xb)
    np.testing.assert_allclose(w.numpy(), rw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), rb, rtol=1e-5, atol=1e-6)
    assert all_equal_bytes([w.numpy(), b.numpy()])
    assert callable(opt.variables) and len(opt.variables()) == len(opt.variables)


def test_elastic_keras_state_with_a_keras2_model():
    """hvd.elastic with a tf-keras model and Adam: sync gives rank 0's model, optimizer
    slots and objects; training inside hvd.elastic.run with the commit callbacks keeps
    the ranks equal; restore puts back the last commit, slots included."""
    x, y = _data()
    model = _model(offset=float(R))
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    state = hvd.elastic.KerasState(model, opt, epoch=R, batch=0)
    assert len(opt.variables()) > 1   # the slots exist from the start (committed)
    state.sync()
    assert state.epoch == 0
    assert all_equal_bytes(model.get_weights() + [v.numpy() for v in opt.variables()])

    @hvd.elastic.run
    def train(state):
        model.fit(x[R].reshape(-1, FEATURES), y[R].reshape(-1, 1), batch_size=ROWS,
                  initial_epoch=state.epoch, epochs=3, shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])

    train(state)
    assert state.epoch == 3 and state.batch == 0
    committed = model.get_weights() + [v.numpy() for v in opt.variables()]
    assert all_equal_bytes(committed)
    assert int(opt.iterations.numpy()) == 3 * STEPS
    model.set_weights([w * 0 for w in model.get_weights()])
    opt.variables()[1].assign(tf.ones_like(opt.variables()[1]))
    state.epoch = 7
    state.restore()
    assert state.epoch == 3
    for a, b in zip(model.get_weights() + [v.numpy() for v in opt.variables()], committed):
        np.testing.assert_array_equal(a, b)


def test_load_model_gives_a_distributed_optimizer_with_its_state(tmp_path_factory):
    """hvd.load_model of a tf-keras model: the optimizer comes back distributed (Horovod's
    class name kept), with its saved state; training on goes on equal on every rank."""
    x, y = _data()
    path = gather(str(tmp_path_factory.mktemp("keras2") / "model.h5"))[0]
    if R == 0:
        model = _model()
        model.compile(optimizer=tf.keras.optimizers.legacy.Adam(lr=0.01), loss="mse")
        model.fit(_global(x), _global(y), batch_size=ROWS * N, epochs=1, shuffle=False,
                  verbose=0)
        model.save(path)
    matex.comm().Barrier()
    loaded = hvd.load_model(path)
    from matex.legacy._keras2 import _DistributedKeras2
    assert isinstance(loaded.optimizer, _DistributedKeras2)
    assert type(loaded.optimizer).__name__ == "Adam"
    assert int(loaded.optimizer.iterations.numpy()) == STEPS
    loaded.fit(x[R].reshape(-1, FEATURES), y[R].reshape(-1, 1), batch_size=ROWS, epochs=1,
               shuffle=False, verbose=0)
    assert all_equal_bytes(loaded.get_weights())


def test_keras3_optimizer_still_gets_the_keras3_path():
    """Keras 3 is unchanged beside tf-keras: its optimizer is wrapped by MaTEx's own."""
    import keras

    from matex.legacy._keras2 import _DistributedKeras2
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(opt, keras.optimizers.Optimizer)
    assert not isinstance(opt, _DistributedKeras2)


def test_transparent_path_refuses_tf_keras_training_on_every_rank():
    """import matex.keras with a tf-keras script on several ranks: fit, train_on_batch and
    apply_gradients raise one clear error on every rank (never N separate models).
    Last in this file: it patches tf-keras for the rest of the process."""
    from matex import _compat
    from matex.legacy import _keras2

    import matex.keras  # noqa: F401
    x, y = _data()
    model = _model()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    before = model.get_weights()
    outcomes = []
    for call in (lambda: model.fit(x[R, 0], y[R, 0], verbose=0),
                 lambda: model.train_on_batch(x[R, 0], y[R, 0]),
                 lambda: tf.keras.optimizers.legacy.SGD().apply_gradients(
                     [(tf.ones((1,)), tf.Variable([1.0]))])):
        if N == 1:
            continue
        with pytest.raises(RuntimeError, match="does not distribute") as info:
            call()
        outcomes.append("separate models" in str(info.value))
    assert all(gather(all(outcomes)))
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    for cls, name in _compat.tf_keras_training_entry_points():   # leave tf-keras as it was
        setattr(cls, name, getattr(cls, name).__wrapped__)
    _keras2._now.refusing = False
    assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
