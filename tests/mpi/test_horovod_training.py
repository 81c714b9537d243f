"""Horovod's training API on MaTEx (#25 item 4), under mpiexec: every rank count.

Gradient accumulation (``backward_passes_per_step``), ``sparse_as_dense``,
integer ``IndexedSlices`` averages, the ``Partial`` optimizer and tape,
``SyncBatchNormalization`` and ``join``: each against NumPy on the whole
job's data.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import matex
import matex.horovod.tensorflow as hvd
import matex.horovod.tensorflow.keras as hvd_keras
from matex.horovod.tensorflow import compression as hvd_compression
from matex import _stats
from helpers import all_equal_bytes, gather

R, N = matex.rank(), matex.size()
LR = 0.1


def _data(calls, rows=4, features=3, seed=5):
    """x[r, k], y[r, k]: rank r's batch at call k (the same arrays on every rank)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, calls, rows, features)).astype("float32")
    y = rng.normal(size=(N, calls, rows, 1)).astype("float32")
    return x, y


def _linear(features=3):
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(1)])
    model.set_weights([np.linspace(-0.5, 0.5, features, dtype="float32").reshape(features, 1),
                       np.array([0.1], "float32")])
    return model


def _mse_grads(w, b, x, y):
    """d mean((xw + b - y)^2) / d(w, b), float64."""
    err = x.astype(np.float64) @ w + b - y
    return 2 * x.T @ err / len(x), 2 * err.sum(0) / len(x)


def _accumulated_reference(x, y, passes, average_aggregated, calls):
    """Weights after ``calls`` calls: every ``passes`` calls, SGD on the accumulated average."""
    w = np.linspace(-0.5, 0.5, x.shape[-1]).reshape(-1, 1)
    b = np.array([0.1])
    for start in range(0, calls, passes):
        gw, gb = 0, 0
        for k in range(start, start + passes):
            for r in range(N):
                dw, db = _mse_grads(w, b, x[r, k], y[r, k])
                gw, gb = gw + dw / N, gb + db / N
        if average_aggregated:
            gw, gb = gw / passes, gb / passes
        w, b = w - LR * gw, b - LR * gb
    return w, b


@pytest.mark.parametrize("average_aggregated", [True, False])
def test_backward_passes_per_step_in_a_loop(average_aggregated):
    """N=2: the optimizer applies every 2nd call the average over ranks of the 2 calls'
    summed (or averaged) gradients, with one reduction per 2 calls; iterations counts
    every call, as Horovod's."""
    calls, passes = 4, 2
    x, y = _data(calls)
    model = _linear()
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR),
                                         backward_passes_per_step=passes,
                                         average_aggregated_gradients=average_aggregated)
    _stats.reset()
    before = [w.copy() for w in model.get_weights()]
    for k in range(calls):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[R, k]) - y[R, k]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if k == 0:   # accumulated only: nothing applied yet
            for a, b in zip(model.get_weights(), before):
                np.testing.assert_array_equal(a, b)
        assert int(opt.iterations.numpy()) == k + 1
    w, b = _accumulated_reference(x, y, passes, average_aggregated, calls)
    np.testing.assert_allclose(model.get_weights()[0], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b, rtol=1e-5, atol=1e-6)
    assert all_equal_bytes(model.get_weights())
    assert _stats.stats()["steps"] == calls // passes   # one reduction per 2 calls


def test_backward_passes_per_step_in_fit():
    """The same in fit (a traced step: the reduction sits in a tf.cond)."""
    calls, passes = 4, 2
    x, y = _data(calls)
    model = _linear()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(
        keras.optimizers.SGD(LR), backward_passes_per_step=passes,
        average_aggregated_gradients=True), loss="mse")
    _stats.reset()
    model.fit(x[R].reshape(-1, 3), y[R].reshape(-1, 1), batch_size=4, epochs=1,
              shuffle=False, verbose=0)
    w, b = _accumulated_reference(x, y, passes, True, calls)
    np.testing.assert_allclose(model.get_weights()[0], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b, rtol=1e-5, atol=1e-6)
    assert all_equal_bytes(model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == calls
    assert _stats.stats()["steps"] == calls // passes


def test_backward_passes_per_step_argument_checks():
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=0)
    # IndexedSlices need sparse_as_dense when accumulating (Horovod's error)
    emb = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(6, 2)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(tf.constant([[1, 2]])))
    grads = tape.gradient(loss, emb.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    with pytest.raises(ValueError, match="sparse_as_dense"):
        opt.apply_gradients(zip(grads, emb.trainable_variables))


def _embedding_model():
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(7, 2)])
    model.set_weights([np.arange(14, dtype="float32").reshape(7, 2) / 10])
    return model


def _embedding_grad(ids, scale):
    """d sum(emb(ids) * scale) / d table, dense, float64."""
    g = np.zeros((7, 2))
    for i in ids.ravel():
        g[i] += scale
    return g


def test_sparse_as_dense_tape_reduces_a_dense_gradient():
    """sparse_as_dense: the embedding's IndexedSlices gradient is made dense, then averaged:
    a tf.Tensor equal to NumPy's average of every rank's dense gradient."""
    model = _embedding_model()
    ids = [np.array([[r % 7, (2 * r + 1) % 7, 3]]) for r in range(N)]
    kinds = []

    @tf.function(autograph=False)
    def step():   # traced: MaTEx's sparse allreduce would give IndexedSlices here
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant(ids[R])) * float(R + 1))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=True)
        grad, = tape.gradient(loss, model.trainable_variables)
        kinds.append(isinstance(grad, tf.IndexedSlices))
        return tf.convert_to_tensor(grad)

    grad = step()
    assert kinds and not any(kinds)   # dense before the reduction
    expected = sum(_embedding_grad(ids[r], r + 1) for r in range(N)) / N
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-6)
    # and accumulated through the optimizer (sparse_as_dense allows IndexedSlices there)
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR), sparse_as_dense=True,
                                         backward_passes_per_step=2)
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant(ids[R])) * float(R + 1))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    start = np.arange(14).reshape(7, 2) / 10
    np.testing.assert_allclose(model.get_weights()[0], start - LR * 2 * expected, rtol=1e-6,
                               atol=1e-7)
    assert all_equal_bytes(model.get_weights())


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.uint8, tf.float32])
def test_indexed_slices_average_follows_horovod(dtype):
    """hvd.allreduce of IndexedSlices, Average: every rank's (values, indices) allgathered,
    the values divided by the ranks as TensorFlow's true division does (integers become
    floats: 3 / 2 = 1.5, not 1)."""
    values = tf.cast(tf.constant([[R + 1, 2 * R + 3]]), dtype)
    result = hvd.allreduce(tf.IndexedSlices(values, tf.constant([R])), op=hvd.Average)
    expected = np.array([[r + 1, 2 * r + 3] for r in range(N)], np.float64) / N
    assert result.values.dtype == (values / 1).dtype
    np.testing.assert_allclose(result.values.numpy(), expected, rtol=1e-6)
    assert result.indices.numpy().tolist() == list(range(N))
    summed = hvd.allreduce(tf.IndexedSlices(values, tf.constant([R])), op=hvd.Sum)
    assert summed.values.dtype == dtype


def _two_layers(seed=3):
    keras.utils.set_random_seed(seed)
    shared = keras.layers.Dense(3, name="shared")
    local = keras.layers.Dense(1, name="local")
    model = keras.Sequential([keras.Input((2,)), shared, local])
    return model, shared, local


def test_partial_tape_keeps_the_local_layers_gradients():
    """PartialDistributedGradientTape(local_layers=[local]): the shared layer's gradients are
    the average over ranks, the local layer's are this rank's own divided by the ranks
    (Horovod's scale_local_gradients); after training the local weights differ across
    ranks and the shared ones do not."""
    model, shared, local = _two_layers()
    rng = np.random.default_rng(11)
    x = rng.normal(size=(N, 5, 2)).astype("float32")
    y = rng.normal(size=(N, 5, 1)).astype("float32")

    def loss_fn(r):
        return tf.reduce_mean(tf.square(model(x[r]) - y[r]))

    own = []
    for r in range(N):   # every rank's plain gradients (the weights are equal on every rank)
        with tf.GradientTape() as tape:
            loss = loss_fn(r)
        own.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    with tf.GradientTape() as tape:
        loss = loss_fn(R)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    grads = tape.gradient(loss, model.trainable_variables)
    for i, (v, g) in enumerate(zip(model.trainable_variables, grads)):
        if any(v is w for w in local.trainable_weights):
            np.testing.assert_allclose(g.numpy(), own[R][i] / N, rtol=1e-6)
        else:
            np.testing.assert_allclose(g.numpy(), sum(o[i] for o in own) / N, rtol=1e-5,
                                       atol=1e-7)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = loss_fn(R)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
        local_pairs, global_pairs = tape.get_local_and_global_gradients(
            loss, model.trainable_variables)
        assert len(local_pairs) == 2 and len(global_pairs) == 2
        for v, g in local_pairs + global_pairs:
            v.assign_sub(LR * g)
    assert all_equal_bytes(shared.get_weights())
    if N > 1:
        kernels = gather(local.get_weights()[0].tobytes())
        assert len(set(kernels)) == N


def test_partial_optimizer_in_fit():
    """PartialDistributedOptimizer in fit: the first step's update of the shared layer is the
    average over ranks, the local layer's this rank's gradient over the ranks; shared
    weights stay bitwise equal, local ones differ."""
    model, shared, local = _two_layers(seed=4)
    rng = np.random.default_rng(12)
    x = rng.normal(size=(N, 4, 2)).astype("float32")
    y = rng.normal(size=(N, 4, 1)).astype("float32")
    start = [v.numpy() for v in model.trainable_variables]
    own = []
    for r in range(N):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[r]) - y[r]))
        own.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    model.compile(optimizer=hvd_keras.PartialDistributedOptimizer(
        keras.optimizers.SGD(LR), local_layers=[local]), loss="mse")
    model.fit(x[R], y[R], batch_size=4, epochs=1, shuffle=False, verbose=0)
    for i, v in enumerate(model.trainable_variables):
        is_local = any(v is w for w in local.trainable_weights)
        g = own[R][i] / N if is_local else sum(o[i] for o in own) / N
        np.testing.assert_allclose(v.numpy(), start[i] - LR * g, rtol=1e-5, atol=1e-7)
    assert all_equal_bytes(shared.get_weights())
    if N > 1:
        assert len(set(gather(local.get_weights()[0].tobytes()))) == N


@pytest.mark.parametrize("split", [[4, 1, 2], [5, 0, 3]], ids=["uneven", "an-empty-rank"])
def test_sync_batch_normalization_is_one_process_on_the_global_batch(split):
    """hvd.SyncBatchNormalization: each rank's slice normalised with the global batch's
    mean and variance, and every rank's moving statistics updated with them, as one
    process on the whole batch; a rank with 0 rows weighs nothing (no NaN anywhere)."""
    rows = split[:N]
    rng = np.random.default_rng(21)
    full = (rng.normal(size=(sum(rows), 3)) * [1.0, 2.0, 0.5] + 3.0).astype("float32")
    mine = full[sum(rows[:R]):sum(rows[:R + 1])]
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    assert layer.name.startswith("sync_batch_normalization")
    out = layer(tf.constant(mine.reshape(-1, 3)), training=True).numpy()
    mean, var = full.astype(np.float64).mean(0), full.astype(np.float64).var(0)
    assert out.shape == (rows[R], 3)
    np.testing.assert_allclose(out, (mine - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.5 + 0.5 * var, rtol=1e-5)
    assert all_equal_bytes([layer.moving_mean.numpy(), layer.moving_variance.numpy()])
    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_join_with_uneven_data(traced):
    """Rank r has r + 1 batches; a rank out of data calls hvd.join() and serves the others'
    gradient reductions and allreduces with zeros. Each step's reduced gradient is the sum
    over the ranks still training divided by all the ranks (Horovod's rule), so every
    rank's weights are NumPy's after its own number of steps; join returns the last rank
    to join (the one with the most batches) on every rank."""
    steps = R + 1
    rng = np.random.default_rng(31)
    x = rng.normal(size=(N, N, 4, 3)).astype("float32")   # x[r, k]: rank r's batch k
    y = rng.normal(size=(N, N, 4, 1)).astype("float32")
    model = _linear()

    def step(xb, yb, value):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):   # SGD by hand: an optimizer
            v.assign_sub(LR * g)   # would be made distributed by matex.keras in this suite
        return (hvd.allreduce(value, op=hvd.Sum), hvd.allreduce(value, op=hvd.Average))

    if traced:
        step = tf.function(step, autograph=False)
    sums = []
    for k in range(steps):
        summed, averaged = step(tf.constant(x[R, k]), tf.constant(y[R, k]),
                                tf.constant([float(R + 1)]))
        sums.append((float(summed[0]), float(averaged[0])))
    last = hvd.join()
    assert int(last) == N - 1
    # NumPy: at step k the ranks r >= k still train
    w, b = np.linspace(-0.5, 0.5, 3).reshape(-1, 1), np.array([0.1])
    for k in range(steps):
        gw, gb = 0, 0
        for r in range(k, N):
            dw, db = _mse_grads(w, b, x[r, k], y[r, k])
            gw, gb = gw + dw / N, gb + db / N
        w, b = w - LR * gw, b - LR * gb
        active = sum(r + 1 for r in range(k, N))
        assert sums[k] == pytest.approx((active, active / N), rel=1e-6)
    np.testing.assert_allclose(model.get_weights()[0], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], b, rtol=1e-5, atol=1e-6)
    # everyone joined: the next reductions are plain again
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == N


def test_join_meets_an_unannounced_collective_with_an_error_on_every_rank():
    """An allgather run while a rank has joined cannot be served: an error on every rank
    (MaTEx's mismatch check), not a hang; the ranks go on afterwards."""
    if N == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises((tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError)):
        if R == 0:
            hvd.join()
        else:
            hvd.allgather(tf.constant([float(R)]))
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == N


NEVER_JOINS = "import horovod.tensorflow as hvd\nimport os\nhvd.init()\nos.path.join('a')\n"
JOINS = "import horovod.tensorflow as hvd\nhvd.init()\nhvd.join()\n"


@pytest.fixture
def main_script(monkeypatch):
    """Pretend the main script is the given source (MATEX_HOROVOD_JOIN=auto decides anew)."""
    from matex.horovod import _join

    def pretend(source):
        monkeypatch.setattr(_join, "_main_script", lambda: source)
        monkeypatch.setattr(_join._now, "decided", None)

    monkeypatch.delenv("MATEX_HOROVOD_JOIN", raising=False)
    yield pretend


def _collectives_of(function):
    from matex import _native

    core = _native.core()
    before = core.flight_sequence()
    function()
    return core.flight_sequence() - before


@pytest.mark.parametrize("source, per_call", [(NEVER_JOINS, 1), (JOINS, 2), (None, 2)],
                         ids=["script-never-joins", "script-joins", "no-script"])
def test_reductions_are_announced_only_where_join_may_be_called(main_script, source,
                                                                 per_call):
    """An eager hvd.allreduce makes one collective in a Horovod script that never calls
    join (Horovod's join costs nothing until used); two (announcement and reduction) where
    the script calls hvd.join, or where there is no script to read (here: pytest). Before,
    every script paid the announcement."""
    main_script(source)
    value = tf.constant([1.0, 2.0])
    assert _collectives_of(lambda: hvd.allreduce(value, op=hvd.Sum)) == per_call
    assert hvd.allreduce(value, op=hvd.Sum).numpy().tolist() == [N * 1.0, N * 2.0]


def test_a_rank_joining_alone_without_announcements_is_told_how_to_turn_them_on(main_script):
    """Announcements off (a script that never calls join): a rank calling hvd.join() while
    the others reduce gets an error naming MATEX_HOROVOD_JOIN, the others the mismatch
    error; no hang, and the ranks go on."""
    if N == 1:
        pytest.skip("needs 2 ranks")
    main_script(NEVER_JOINS)
    if R == 0:
        with pytest.raises(RuntimeError, match="MATEX_HOROVOD_JOIN=1"):
            hvd.join()
    else:
        with pytest.raises((tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError)):
            hvd.allreduce(tf.constant([float(R)] * 5), op=hvd.Sum)
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == N


def test_one_rank_alone_may_read_the_cross_figures():
    """``if hvd.rank() == 0: print(hvd.cross_size())``: the figures of a communicator are
    computed when it is set, so rank 0 alone reads them locally. Before, the first call on
    a communicator was a collective: here, on a communicator set just now (as a shrink
    sets one), rank 0's Split met the others' allgather and the job hung."""
    from matex import _runtime

    world, owned = matex.comm(), _runtime._now.owned
    _runtime._now.owned = False     # world stays alive while a fresh communicator stands in
    _runtime._set_comm(world.Dup(), owned=True)
    try:
        mine = (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) if R == 0 else None
        everyone = matex.comm().allgather(mine)
    finally:
        _runtime._set_comm(world, owned=owned)
    assert everyone == [(0, 1, True)] + [None] * (N - 1)
    # one node here: every rank is node 0 of 1
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)


class _HalvingCompressor(hvd_compression.Compressor):
    """A user's compressor whose round trip halves (compress x2, decompress /4): the
    result shows whether it was applied, and where."""

    @staticmethod
    def compress(tensor):
        return tensor * 2.0, "ctx"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "ctx"
        return tensor / 4.0


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_users_compressor_is_applied_by_the_tape_and_the_optimizer(traced):
    """compression=<the user's hvd.Compressor> was silently replaced by none: the tape's
    and the optimizer's averages now go through its compress and decompress."""
    x, y = _data(1)
    model = _linear()

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[R, 0]) - y[R, 0]))
        tape = hvd.DistributedGradientTape(tape, compression=_HalvingCompressor)
        return tape.gradient(loss, model.trainable_variables)

    got = (tf.function(grads) if traced else grads)()
    w, b = model.get_weights()
    per_rank = [_mse_grads(w, b, x[r, 0], y[r, 0]) for r in range(N)]
    mean_w = sum(g[0] for g in per_rank) / N
    mean_b = sum(g[1] for g in per_rank) / N
    np.testing.assert_allclose(got[0].numpy(), mean_w / 2, rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), mean_b / 2, rtol=1e-5)
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR),
                                         compression=_HalvingCompressor)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[R, 0]) - y[R, 0]))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables))
    np.testing.assert_allclose(model.get_weights()[0], w - LR * mean_w / 2, rtol=1e-5)
    assert all_equal_bytes(model.get_weights())


def test_grouped_allreduce_scales_as_allreduce_does():
    """hvd.grouped_allreduce applied pre/postscale itself (int32 Average with a postscale
    rounded differently, float16 scaled in float16); it now takes allreduce's rules:
    each grouped result equals the lone allreduce's, bit for bit (float sums here are
    exact: a float sum's rounding may depend on how the message is cut)."""
    cases = [(tf.int32, hvd.Average, 1.0, 2.0), (tf.int32, hvd.Sum, 0.7, 1.0),
             (tf.float16, hvd.Sum, 0.5, 2.0), (tf.float32, hvd.Average, 4.0, 0.25)]
    for dtype, op, pre, post in cases:
        values = [tf.cast(tf.constant([1 + R, 7 * (R + 1), 1 + R * R]), dtype),
                  tf.cast(tf.constant([[5 + R, 2], [3, 9 * R]]), dtype)]
        grouped = hvd.grouped_allreduce(values, op=op, prescale_factor=pre,
                                        postscale_factor=post)
        alone = [hvd.allreduce(v, op=op, prescale_factor=pre, postscale_factor=post)
                 for v in values]
        for g, a in zip(grouped, alone):
            assert g.dtype == a.dtype == dtype
            np.testing.assert_array_equal(g.numpy(), a.numpy(), err_msg=str((dtype, op)))


def test_sparse_average_divides_by_the_size_when_it_runs():
    """A traced IndexedSlices Average divided by the size at trace time: after the
    communicator changed (as a shrink changes it) it was wrong. Here the same traced
    function runs on the world, then on halves of it (rank parity)."""
    from matex import _runtime

    @tf.function
    def average(values):
        slices = tf.IndexedSlices(values, tf.constant([R]), tf.constant([N, 2]))
        return hvd.allreduce(slices, op=hvd.Average).values

    mine = tf.constant([[float(R + 1), 2.0 * R]])
    np.testing.assert_allclose(average(mine).numpy(),
                               [[r + 1.0, 2.0 * r] for r in range(N)] / np.float32(N))
    world, owned = matex.comm(), _runtime._now.owned
    half = world.Split(R % 2, R)
    _runtime._now.owned = False
    _runtime._set_comm(half, owned=True)
    try:
        got = average(mine).numpy()
    finally:
        _runtime._set_comm(world, owned=owned)
    members = [r for r in range(N) if r % 2 == R % 2]
    np.testing.assert_allclose(got, [[r + 1.0, 2.0 * r] for r in members]
                               / np.float32(len(members)))
