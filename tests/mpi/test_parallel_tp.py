"""matex.parallel under mpiexec (2 or 4 ranks): point-to-point ops, the grid,
tensor-parallel layers against a 1-process Keras reference computed on each rank."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import matex
import matex.parallel as mp
from helpers import gather

RANK, SIZE = matex.rank(), matex.size()
PARTNER = RANK ^ 1          # pairs (0, 1), (2, 3)
T = 2                       # tensor-parallel size in every grid below
pytestmark = pytest.mark.skipif(SIZE % 2, reason="needs an even number of ranks")


# ---- point-to-point -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "function"])
def test_send_recv_values(mode):
    def exchange():
        if RANK % 2 == 0:
            token = mp.send(tf.constant([1.0, 2.0, 3.0]) + RANK, PARTNER, tag=5)
            got = mp.recv([2, 2], tf.int64, PARTNER, tag=6)
            return token, got
        got = mp.recv([3], tf.float32, PARTNER, tag=5)
        token = mp.send(tf.reshape(tf.range(4, dtype=tf.int64), [2, 2]) * RANK, PARTNER, tag=6)
        return token, got
    run = exchange if mode == "eager" else tf.function(exchange)
    token, got = run()
    assert float(token) == 0.0
    if RANK % 2 == 0:
        np.testing.assert_array_equal(got.numpy(), np.arange(4).reshape(2, 2) * PARTNER)
    else:
        np.testing.assert_array_equal(got.numpy(), np.array([1.0, 2.0, 3.0]) + PARTNER)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sendrecv_ring(mode):
    def ring(x):
        return mp.sendrecv(x, (RANK + 1) % SIZE, (RANK - 1) % SIZE, tf.shape(x), tf.float64,
                           tag=1)
    run = ring if mode == "eager" else tf.function(ring)
    got = run(tf.fill([3, 2], tf.constant(RANK, tf.float64)))
    np.testing.assert_array_equal(got.numpy(), np.full([3, 2], (RANK - 1) % SIZE))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradients_through_send_and_recv(mode):
    # even rank: y = v0 * x, sent; odd rank: L = sum(r^2 * v1) of the received r.
    # dL/dv1 = r^2; dL/dr = 2 r v1 goes back, dL/dv0 = x * 2 r v1.
    x = np.array([1.0, 2.0], np.float32)
    v = tf.Variable([3.0, 4.0]) if RANK % 2 == 0 else tf.Variable([0.5, -1.0])

    def step():
        with tf.GradientTape() as tape:
            if RANK % 2 == 0:
                target = mp.send(v * x, PARTNER, tag=2)
            else:
                r = mp.recv([2], tf.float32, PARTNER, tag=2)
                target = tf.reduce_sum(r * r * v)
        return tape.gradient(target, v)
    grad = (step if mode == "eager" else tf.function(step))().numpy()
    v0, v1 = np.array([3.0, 4.0]), np.array([0.5, -1.0])
    r = v0 * x
    expected = x * 2 * r * v1 if RANK % 2 == 0 else r * r
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_gradient_of_sendrecv():
    # y = sendrecv(v * x) from the partner; L = sum(c * y): dL/dv = x * c_partner.
    x = tf.constant([1.0, -2.0, 0.5])
    v = tf.Variable([1.0, 1.0, 1.0])
    c = tf.constant([1.0, 2.0, 3.0]) * (RANK + 1)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y = mp.sendrecv(v * x, PARTNER, PARTNER, [3], tf.float32, tag=3)
            loss = tf.reduce_sum(c * y)
        return tape.gradient(loss, v)
    expected = x.numpy() * np.array([1.0, 2.0, 3.0]) * (PARTNER + 1)
    np.testing.assert_allclose(step().numpy(), expected, rtol=1e-6)


def test_mismatch_fails_on_both_ends_then_transfers_work():
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        if RANK % 2 == 0:
            mp.send(tf.zeros([4]), PARTNER, tag=7)
        else:
            mp.recv([5], tf.float32, PARTNER, tag=7)
    assert "rank %d sends float32[4]" % (RANK - RANK % 2) in str(info.value)
    assert "receives float32[5]" in str(info.value)
    with pytest.raises(tf.errors.InvalidArgumentError, match="int32"):
        if RANK % 2 == 0:
            mp.send(tf.zeros([2], tf.int32), PARTNER, tag=7)
        else:
            mp.recv([2], tf.float32, PARTNER, tag=7)
    # nothing was left in flight: the next transfer on the same tag is intact
    got = mp.sendrecv(tf.constant([float(RANK)]), PARTNER, PARTNER, [1], tf.float32, tag=7)
    assert float(got[0]) == PARTNER


def test_bad_arguments():
    with pytest.raises(ValueError, match="tag"):
        mp.send(tf.zeros([1]), PARTNER, tag=10 ** 6)
    with pytest.raises(tf.errors.InternalError, match="not a rank"):
        mp.send(tf.zeros([1]), SIZE + 3)


# ---- grid -------------------------------------------------------------------------

def test_grid_coordinates_and_communicators():
    world = matex.comm()
    w = world.Get_rank()
    with mp.grid(tensor=T) as g:
        d = SIZE // T
        assert g.shape == (d, 1, T)
        assert (g.data_rank, g.pipeline_rank, g.tensor_rank) == (w // T, 0, w % T)
        assert g.world_rank_of() == w and g.coordinates_of(w) == (w // T, 0, w % T)
        assert g.world_rank_of(tensor=1 - g.tensor_rank) == w ^ 1
        assert matex.size() == d and matex.rank() == g.data_rank        # slot 0 = data comm
        assert g.tensor_comm.Get_size() == T and g.pipeline_comm.Get_size() == 1
        tsum = matex.allreduce(tf.constant(float(w)), op="sum", comm=g.tensor_slot)
        dsum = matex.allreduce(tf.constant(float(w)), op="sum")
        assert float(tsum) == sum(r for r in range(SIZE) if r // T == w // T)
        assert float(dsum) == sum(r for r in range(SIZE) if r % T == w % T)
        # p2p on a sub-communicator: ranks are ranks within it
        got = mp.sendrecv(tf.constant([float(w)]), 1 - g.tensor_rank, 1 - g.tensor_rank, [1],
                          tf.float32, comm=g.tensor_slot)
        assert float(got[0]) == w ^ 1
    assert matex.size() == SIZE and matex.rank() == w
    if SIZE == 4:
        with mp.grid(data=1, pipeline=2, tensor=2) as g:
            assert (g.pipeline_rank, g.tensor_rank) == (w // 2, w % 2)
            assert g.pipeline_comm.Get_size() == 2 and matex.size() == 1


def test_grid_product_error_on_every_rank():
    messages = []
    for kwargs in ({"data": SIZE + 1}, {"data": 1, "pipeline": 1, "tensor": 3},
                   {"tensor": 0}):
        try:
            mp.grid(**kwargs)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    everyone = gather(messages)
    assert all(m == messages for m in everyone)
    assert "the product must equal the number of ranks" in messages[0]
    assert "%d ranks" % SIZE in messages[0]
    assert messages[1] is not None and messages[2] is not None
    assert matex.size() == SIZE       # nothing installed


def test_distributed_optimizer_averages_over_data_dimension_only():
    w = matex.rank()
    with mp.grid(tensor=T):
        v = keras.Variable(np.zeros(1, np.float32))
        opt = matex.DistributedOptimizer(keras.optimizers.SGD(1.0))
        opt.apply_gradients([(tf.constant([float(w)]), v)])
        group = [r for r in range(SIZE) if r % T == w % T]   # same tensor rank
        np.testing.assert_allclose(v.numpy(), [-np.mean(group)])


# ---- tensor-parallel layers --------------------------------------------------------

def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def _column_row_model(d, g):
    """A d -> d column-parallel then row-parallel pair (two d x d kernels), seeded."""
    return keras.Sequential([
        keras.Input((d,)),
        mp.ColumnParallelDense(d, kernel_initializer=_init(30), gather_output=False,
                               grid=g, name="col"),
        mp.RowParallelDense(d, kernel_initializer=_init(31), grid=g, name="row")])


def _data(n, shape_in, n_out, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n,) + shape_in).astype(np.float32),
            rng.standard_normal((n, n_out)).astype(np.float32))


def _local_batches(a, batch, d, dsize):
    """This data replica's slice of every global batch of ``batch`` rows."""
    per = batch // dsize
    return np.concatenate([a[b + d * per:b + (d + 1) * per] for b in range(0, len(a), batch)])


def _train_and_compare(make_reference, make_parallel, x, y, check_weights, batch=4):
    reference = make_reference()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with mp.grid(tensor=T) as g:
        model = make_parallel(g)
        model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                      loss="mse")
        np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                                   rtol=1e-4, atol=1e-6)
        reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        xl, yl = (_local_batches(a, batch, g.data_rank, g.data_size) for a in (x, y))
        model.fit(xl, yl, batch_size=batch // g.data_size, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                                   reference.evaluate(x, y, verbose=0), rtol=1e-4)
        np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                                   rtol=1e-4, atol=1e-5)
        check_weights(model, reference, g.tensor_rank)
        ratio = mp.parameter_bytes(model) / mp.parameter_bytes(reference)
    return ratio


def test_column_row_dense_equals_unsharded_model():
    x, y = _data(16, (6,), 4, 0)

    def reference():
        return keras.Sequential([keras.Input((6,)),
                                 keras.layers.Dense(8, "tanh", kernel_initializer=_init(1),
                                                    bias_initializer=_init(2)),
                                 keras.layers.Dense(4, kernel_initializer=_init(3))])

    def parallel(g):
        return keras.Sequential([
            keras.Input((6,)),
            mp.ColumnParallelDense(8, "tanh", kernel_initializer=_init(1),
                                   bias_initializer=_init(2), gather_output=False, grid=g),
            mp.RowParallelDense(4, kernel_initializer=_init(3), input_is_parallel=True, grid=g)])

    def check(model, ref, t):
        k1, b1, k2, b2 = (w.numpy() for w in ref.weights)
        m1, c1, m2, c2 = (w.numpy() for w in model.weights)
        np.testing.assert_allclose(m1, k1[:, 4 * t:4 * t + 4], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(c1, b1[4 * t:4 * t + 4], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(m2, k2[4 * t:4 * t + 4], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(c2, b2, rtol=1e-4, atol=1e-6)
    _train_and_compare(reference, parallel, x, y, check)


def test_parallel_conv2d_equals_unsharded_model():
    x, y = _data(8, (5, 5, 2), 3, 1)

    def reference():
        return keras.Sequential([keras.Input((5, 5, 2)),
                                 keras.layers.Conv2D(4, 3, padding="same", activation="relu",
                                                     kernel_initializer=_init(4)),
                                 keras.layers.Flatten(),
                                 keras.layers.Dense(3, kernel_initializer=_init(5))])

    def parallel(g):
        return keras.Sequential([keras.Input((5, 5, 2)),
                                 mp.ParallelConv2D(4, 3, padding="same", activation="relu",
                                                   kernel_initializer=_init(4), grid=g),
                                 keras.layers.Flatten(),
                                 keras.layers.Dense(3, kernel_initializer=_init(5))])

    def check(model, ref, t):
        k, b = ref.weights[0].numpy(), ref.weights[1].numpy()
        np.testing.assert_allclose(model.weights[0].numpy(), k[..., 2 * t:2 * t + 2],
                                   rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(model.weights[1].numpy(), b[2 * t:2 * t + 2],
                                   rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(model.weights[2].numpy(), ref.weights[2].numpy(),
                                   rtol=1e-4, atol=1e-6)
    _train_and_compare(reference, parallel, x, y, check)


def test_shard_layer_and_parameter_bytes():
    x = np.random.default_rng(2).standard_normal((5, 32)).astype(np.float32)
    dense1 = keras.layers.Dense(64, "relu", kernel_initializer=_init(6), bias_initializer=_init(7))
    dense2 = keras.layers.Dense(32, kernel_initializer=_init(8), bias_initializer=_init(9))
    expected = dense2(dense1(x)).numpy()
    conv = keras.layers.Conv2D(6, 2, kernel_initializer=_init(10), bias_initializer=_init(11))
    images = x[:, :27].reshape(5, 3, 3, 3)
    expected_conv = conv(images).numpy()
    with mp.grid(tensor=T) as g:
        col = mp.shard_layer(dense1, g, "column", gather_output=False)
        row = mp.shard_layer(dense2, g, "row", input_is_parallel=True)
        np.testing.assert_allclose(row(col(x)).numpy(), expected, rtol=1e-4, atol=1e-5)
        gathered = mp.shard_layer(dense1, g, "column")
        np.testing.assert_allclose(gathered(x).numpy(), dense1(x).numpy(), rtol=1e-5, atol=1e-6)
        whole_row = mp.shard_layer(dense2, g, "row")       # slices its full input itself
        np.testing.assert_allclose(whole_row(dense1(x)).numpy(), expected, rtol=1e-4, atol=1e-5)
        pconv = mp.shard_layer(conv, g, "column")
        np.testing.assert_allclose(pconv(images).numpy(), expected_conv, rtol=1e-4, atol=1e-5)
        ratio = (mp.parameter_bytes(col) + mp.parameter_bytes(row)) / (
            mp.parameter_bytes(dense1) + mp.parameter_bytes(dense2))
        assert abs(ratio - 1 / T) < 0.01, ratio    # only the row layer's bias is replicated
        assert mp.parameter_bytes(pconv) * T == mp.parameter_bytes(conv)
        config = col.get_config()
        again = mp.ColumnParallelDense.from_config(config)
        assert again.units == 64 and again.gather_output is False
        with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
            mp.ColumnParallelDense(7, grid=g)
        with pytest.raises(ValueError, match="not divisible"):
            mp.ParallelConv2D(3, 2, grid=g)
        with pytest.raises(ValueError, match="only be split over its output channels"):
            mp.shard_layer(conv, g, "row")
    with pytest.raises(ValueError, match="need a grid"):
        mp.ColumnParallelDense(8)


def test_save_model_gathers_shards_into_plain_keras(tmp_path):
    """mp.save_model: the file (written by rank 0) holds plain Conv2D / Dense layers with
    every shard, loads without MaTEx's classes and predicts like the split model."""
    x, _ = _data(6, (5, 5, 2), 3, 3)
    with mp.grid(tensor=T) as g:
        model = keras.Sequential([
            keras.Input((5, 5, 2)),
            mp.ParallelConv2D(4, 3, padding="same", activation="relu",
                              kernel_initializer=_init(12), bias_initializer=_init(13),
                              gather_output=True, name="conv"),
            keras.layers.Flatten(name="flat"),
            mp.ColumnParallelDense(8, "tanh", kernel_initializer=_init(14),
                                   bias_initializer=_init(15), gather_output=False, name="col"),
            mp.RowParallelDense(3, kernel_initializer=_init(16), bias_initializer=_init(17),
                                name="row")])
        expected = model.predict(x, verbose=0)
        path = gather(str(tmp_path / "tp.keras"))[0]   # rank 0's path, on every rank
        mp.save_model(model, path)
        assert (mp.gather_model(model, g) is None) == (g.world_rank != 0)
        if g.world_rank == 0:
            whole = keras.models.load_model(path)
            assert [type(layer).__name__ for layer in whole.layers] == [
                "Conv2D", "Flatten", "Dense", "Dense"]
            assert [tuple(w.shape) for w in whole.weights] == [
                (3, 3, 2, 4), (4,), (100, 8), (8,), (8, 3), (3,)]
            np.testing.assert_allclose(whole.predict(x, verbose=0), expected,
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no grid"):
        mp.save_model(model, path)


def _memory_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def test_layers_build_only_their_shard(monkeypatch):
    """Each rank creates only its slice of the kernel and bias (same values as the full
    seeded draw), and building never holds the whole kernel: peak growth of a
    8192x8192 ColumnParallelDense is about its 128 MiB shard, not the 256 MiB kernel."""
    from matex.parallel import _tensor

    ki = keras.initializers
    with mp.grid(tensor=T) as g:
        t = g.tensor_rank
        # values: multi-block draws (blocks of 7 elements) equal the full draw's slice
        monkeypatch.setattr(_tensor, "_BLOCK_ELEMENTS", 7, raising=False)
        for init in (_init(20), ki.HeNormal(21), ki.RandomNormal(0.5, 2.0, seed=22),
                     ki.TruncatedNormal(0.0, 0.3, seed=23)):
            col = mp.ColumnParallelDense(10, kernel_initializer=init, bias_initializer=init,
                                         grid=g)
            row = mp.RowParallelDense(6, kernel_initializer=init, bias_initializer=init,
                                      grid=g, input_is_parallel=False)
            conv = mp.ParallelConv2D(8, 3, kernel_initializer=init, bias_initializer=init,
                                     grid=g)
            col.build((None, 13))
            row.build((None, 10))
            conv.build((None, 5, 5, 3))
            for layer, weights in (
                    (col, [init((13, 10))[:, 5 * t:5 * t + 5], init((10,))[5 * t:5 * t + 5]]),
                    (row, [init((10, 6))[5 * t:5 * t + 5], init((6,))]),
                    (conv, [init((3, 3, 3, 8))[..., 4 * t:4 * t + 4],
                            init((8,))[4 * t:4 * t + 4]])):
                for got, want in zip(layer.weights, weights):
                    np.testing.assert_array_equal(got.numpy(), np.asarray(want))
        monkeypatch.undo()
        # memory: only shard-shaped variables, and the build's peak is about the shard
        big = mp.ColumnParallelDense(8, kernel_initializer=_init(24), grid=g)
        big.build((None, 8))                        # warm up the ops
        n, full = 8192, 8192 * 8192 * 4
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                            # reset the peak (VmHWM) to now
        base = _memory_kib("VmRSS:")
        big = mp.ColumnParallelDense(n, kernel_initializer=_init(24), grid=g)
        big.build((None, n))
        grown = (_memory_kib("VmHWM:") - base) * 1024
        assert [tuple(w.shape) for w in big.weights] == [(n, n // T), (n // T,)]
        assert mp.parameter_bytes(big) == (full + 4 * n) // T
        assert full / T * 0.9 < grown < full * 0.75, (grown / 2 ** 20, full / 2 ** 20)
        del big


def test_gather_model_streams_weights_to_root():
    """mp.gather_model hands root one weight at a time (stream_gather): the other ranks
    never hold a whole layer (before: every tensor rank allgathered every layer, 208 MiB
    peak growth on rank 1 for this 128 MiB model; now what reading its own shard once
    costs, measured just before). An error in root's sink, or a piece no rank holds, is
    one ValueError on every rank."""
    from matex.parallel import _tensor

    d = 4096
    with mp.grid(tensor=T) as g:
        model = _column_row_model(d, g)
        # the reference: what reading this rank's own shard once costs here (TensorFlow's
        # read and the NumPy copy: one or two shard sizes, depending on the allocator)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _memory_kib("VmRSS:")
        shard = np.asarray(model.get_layer("col").kernel)
        read_cost = (_memory_kib("VmHWM:") - base) * 1024
        del shard
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _memory_kib("VmRSS:")
        whole = mp.gather_model(model, g)
        grown = (_memory_kib("VmHWM:") - base) * 1024
        layer_bytes = d * d * 4
        if g.world_rank == 0:
            np.testing.assert_array_equal(whole.get_layer("col").kernel.numpy(),
                                          np.asarray(_init(30)((d, d))))
            np.testing.assert_array_equal(whole.get_layer("row").kernel.numpy(),
                                          np.asarray(_init(31)((d, d))))
        else:
            assert whole is None
            # one shard read at a time, never a whole layer of another rank's (the
            # allgather it replaced grew 208 MiB here)
            assert grown <= read_cost + 8 * 2 ** 20, (grown / 2 ** 20, read_cost / 2 ** 20)
            assert grown < 1.25 * layer_bytes, grown / 2 ** 20
        del whole
        # errors: raised on every rank, with the same message
        world = g.world_comm
        offers = [(("w", 0), world.Get_rank(), world.Get_size(), 0,
                   lambda: np.full((2,), world.Get_rank(), np.float32))]
        got = []
        _tensor.stream_gather(world, 0, offers, lambda key, v: got.append((key, v)), "t")
        if world.Get_rank() == 0:
            assert len(got) == 1 and got[0][0] == ("w", 0)
            np.testing.assert_array_equal(got[0][1], np.repeat(np.arange(SIZE), 2))

        def bad_sink(key, value):
            raise RuntimeError("disk full")
        with pytest.raises(ValueError, match="rank 0: RuntimeError: disk full"):
            _tensor.stream_gather(world, 0, offers, bad_sink, "t")
        partial = offers if world.Get_rank() else []
        with pytest.raises(ValueError, match=r"no rank holds part\(s\) \[0\]"):
            _tensor.stream_gather(world, 0, partial, lambda key, v: None, "t")
        # the communicator is still in step: a plain gather works after the errors
        _tensor.stream_gather(world, 0, offers, lambda key, v: None, "t")


def test_save_model_streams_into_the_file_without_the_whole_model(tmp_path):
    """mp.save_model: rank 0 builds the plain model weightless and writes each shard into
    the file as it arrives, so its peak growth is about one shard, not the model (before:
    it built and held the whole plain model, 128 MiB of weights plus the initialisers'
    draws: 320 MiB growth for this model). The file loads with plain Keras, with every
    shard in place. Writing to a missing directory is one RemoteError on every rank, a
    failure while writing one ValueError on every rank that leaves no file behind, and
    an existing file it was to replace as it was."""
    from matex.errors import MatexError

    d = 4096
    with mp.grid(tensor=T) as g:
        model = _column_row_model(d, g)
        model.compile(optimizer="adam", loss="mse")   # the file keeps the compile config
        path = gather(str(tmp_path / "big.keras"))[0]
        mp.save_model(model, path)               # warm up (imports, h5py, zipfile)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _memory_kib("VmRSS:")
        mp.save_model(model, path)
        grown = (_memory_kib("VmHWM:") - base) * 1024
        # an unwritable path: the same error on every rank, no partial file, still in step
        bad = str(tmp_path / "missing" / "big.keras")
        with pytest.raises(MatexError, match=r"matex.parallel: saving .*missing.*rank 0: "
                                             r"FileNotFoundError"):
            mp.save_model(model, bad)
        assert g.world_comm.allgather(grown) and not (tmp_path / "missing").exists()
        # a failure while writing on rank 0: one ValueError everywhere, the partial file gone
        from matex.parallel import _streamsave

        def full(self, *args):
            raise OSError("disk full")
        original = _streamsave.StreamedKerasFile.write
        _streamsave.StreamedKerasFile.write = full
        try:
            partial = gather(str(tmp_path / "partial.keras"))[0]
            with pytest.raises(ValueError, match="rank 0: OSError: disk full"):
                mp.save_model(model, partial)
            # the same failure over an existing file leaves that file as it was
            before = open(path, "rb").read() if g.world_rank == 0 else None
            with pytest.raises(ValueError, match="rank 0: OSError: disk full"):
                mp.save_model(model, path)
            if g.world_rank == 0:
                assert open(path, "rb").read() == before
        finally:
            _streamsave.StreamedKerasFile.write = original
        if g.world_rank == 0:   # no partial file, no temporary weights file left behind
            assert sorted(p.name for p in tmp_path.iterdir()) == ["big.keras"]
        print("save_model peak growth, world rank %d: %.1f MiB"
              % (g.world_rank, grown / 2 ** 20))
        weight_bytes = d * d * 4                 # one kernel; the model is two (128 MiB)
        if g.world_rank == 0:                    # (no collective below: rank 0 may fail alone)
            # one shard is weight_bytes / T (32 MiB); a piece and its copy on the way into
            # the file (whether both are resident at once depends on the allocator: 48 and
            # 64 MiB both seen on this machine) stay under 1.25 weights. The whole plain
            # model this replaced grew by 320 MiB.
            assert grown < 1.25 * weight_bytes, grown / 2 ** 20
            whole = keras.models.load_model(path)
            assert [type(layer).__name__ for layer in whole.layers] == ["Dense", "Dense"]
            assert type(whole.optimizer).__name__ == "Adam" and whole.loss == "mse"
            np.testing.assert_array_equal(whole.get_layer("col").kernel.numpy(),
                                          np.asarray(_init(30)((d, d))))
            np.testing.assert_array_equal(whole.get_layer("row").kernel.numpy(),
                                          np.asarray(_init(31)((d, d))))
            np.testing.assert_array_equal(whole.get_layer("row").bias.numpy(), np.zeros(d))
            del whole


@keras.saving.register_keras_serializable("matex_tests")
class _ValueMade(keras.layers.Layer):
    """Makes its variable from a value, not an initializer: it cannot be built weightless."""

    def build(self, input_shape):
        self.scale = keras.Variable(np.full((input_shape[-1],), 2.0, np.float32), name="scale")

    def call(self, x):
        return x * self.scale


def test_save_model_of_a_layer_that_cannot_be_built_weightless(tmp_path, caplog):
    """A layer that cannot be built without its weights: save_model warns and rank 0
    builds the plain model whole (the previous cost), still streaming the weights into
    the file: the file holds the trained values and predicts like the split model."""
    x, _ = _data(5, (4,), 6, 40)
    with mp.grid(tensor=T) as g:
        model = keras.Sequential([
            keras.Input((4,)),
            mp.ColumnParallelDense(6, kernel_initializer=_init(41), gather_output=True,
                                   grid=g, name="col"),
            _ValueMade(name="v")])
        model.get_layer("v").scale.assign(np.arange(6, dtype=np.float32))
        expected = model.predict(x, verbose=0)
        path = gather(str(tmp_path / "value_made.keras"))[0]
        with caplog.at_level("WARNING", logger="matex"):
            mp.save_model(model, path)
        if g.world_rank == 0:
            assert "cannot be built without its weights" in caplog.text
            whole = keras.models.load_model(path)
            np.testing.assert_array_equal(whole.get_layer("v").scale.numpy(), np.arange(6))
            np.testing.assert_allclose(whole.predict(x, verbose=0), expected,
                                       rtol=1e-6, atol=1e-6)
