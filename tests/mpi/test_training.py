"""Data-parallel training on several ranks: averaged gradients, identical weights."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import matex
from helpers import all_equal_bytes, gather

R, N = matex.rank(), matex.size()


def rank_data(r, n=96, seed=0):
    """Rank r's own training data: a different slice of one linear problem."""
    rng = np.random.default_rng(seed + 31 * r)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = np.linspace(-1, 1, 8 * 3).reshape(8, 3).astype(np.float32)
    y = np.argmax(x @ w + 0.1 * rng.normal(size=(n, 3)), axis=1)
    return x, y


def make_model(seed):
    # A different seed per rank gives different initial weights: the first
    # step must start from rank 0's.
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3)])


def make_step(model, opt, tape_wrapper=lambda tape: tape):
    """A tf.function custom-loop step; returns the loss averaged over ranks."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape_wrapper(tape).gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return matex.allreduce(loss, "average")

    return step


@pytest.mark.parametrize("jit", [False, True], ids=["no-xla", "xla-split"])
def test_fit_keeps_weights_bitwise_equal_and_learns(jit):
    model = make_model(seed=100 + R)
    opt = matex.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, jit_compile=jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = rank_data(R)
    hist = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
    losses = hist.history["loss"]
    equal = all_equal_bytes(model.get_weights())
    equal_opt = all_equal_bytes([v.numpy() for v in opt.variables])
    assert equal, "weights differ across ranks"
    assert equal_opt, "optimizer state differs across ranks"
    assert losses[-1] < losses[0] * 0.8, losses


def test_fit_first_step_starts_from_rank0_weights():
    model = make_model(seed=200 + R)
    initial = model.get_weights()
    root_initial = gather(initial)[0]
    model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = rank_data(R)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for got, want in zip(model.get_weights(), root_initial):
        np.testing.assert_array_equal(got, want)


def test_gradients_are_averaged_not_summed_or_local():
    # One SGD step by hand: w1 = w0 - lr * mean_r(grad_r).
    model = make_model(seed=7)          # same init everywhere
    x, y = rank_data(R, n=32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        local_loss = loss_fn(y, model(x, training=True))
    local = [g.numpy() for g in tape.gradient(local_loss, model.trainable_variables)]
    everyone = gather(local)
    w0 = [v.numpy() for v in model.trainable_variables]
    opt = matex.DistributedOptimizer(keras.optimizers.SGD(0.5))
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    for i, v in enumerate(model.trainable_variables):
        mean = np.mean([g[i] for g in everyone], axis=0)
        np.testing.assert_allclose(v.numpy(), w0[i] - 0.5 * mean, rtol=1e-5, atol=1e-6)


def test_custom_loop_with_distributed_tape_in_tf_function():
    model = make_model(seed=300 + R)
    matex.broadcast_variables(model.variables, root=0)
    opt = keras.optimizers.SGD(0.1)
    x, y = rank_data(R)

    step = make_step(model, opt, tape_wrapper=matex.DistributedGradientTape)

    losses = []
    for epoch in range(5):
        for i in range(0, len(x), 16):
            loss = step(x[i:i + 16], y[i:i + 16])
        losses.append(float(loss))
    assert all_equal_bytes(model.get_weights())
    assert losses[-1] < losses[0], losses


def test_custom_loop_distributed_optimizer_syncs_first_step_in_graph():
    model = make_model(seed=400 + R)          # different init per rank, no broadcast
    opt = matex.DistributedOptimizer(keras.optimizers.SGD(0.1))
    x, y = rank_data(R)

    step = make_step(model, opt)

    for i in range(0, len(x), 16):
        step(x[i:i + 16], y[i:i + 16])
    assert all_equal_bytes(model.get_weights())


def test_wrapping_keeps_class_identity_for_saving_and_rejects_bad_input():
    opt = matex.DistributedOptimizer("adam")
    assert type(opt).__name__ == "Adam" and isinstance(opt, keras.optimizers.Adam)
    assert matex.DistributedOptimizer(opt) is opt
    config = keras.optimizers.serialize(opt)
    assert config["class_name"] == "Adam"
    assert isinstance(matex.DistributedOptimizer(keras.optimizers.SGD), keras.optimizers.SGD)
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        matex.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="'average', 'sum' or 'adasum', not 'max'"):
        matex.DistributedOptimizer("sgd", op="max")


def test_xla_split_matches_plain_step():
    # The XLA-split step computes the same update as the plain one.
    results = []
    for jit in (False, True):
        model = make_model(seed=11)
        model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit)
        x, y = rank_data(R)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fit_does_not_read_the_step_counter_on_the_host_every_step():
    # A host read of optimizer.iterations per step (for fault injection, off here) cost
    # every step an eager op and a wait for the step's end
    import matex.keras  # noqa: F401
    from matex import _compat

    variable_class = _compat.keras_variable_class()
    original = variable_class.__int__
    reads = []

    def counting(self):
        reads.append(getattr(self, "path", ""))
        return original(self)

    x, y = rank_data(0, n=96)
    model = make_model(5)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    variable_class.__int__ = counting
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)   # 12 steps
    finally:
        variable_class.__int__ = original
    counter = [r for r in reads if "iteration" in r]
    assert len(counter) < 12, reads
    assert all_equal_bytes([w.numpy() for w in model.weights])
