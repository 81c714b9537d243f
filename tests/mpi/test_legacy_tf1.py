"""Horovod's TF1 API on MaTEx (``tf.compat.v1`` graphs and Sessions), per rank.

Every training check runs the same graph twice: distributed (each rank feeds
its rows of one global batch, rank-specific initial values, rank 0's
broadcast) and in this process alone over the whole batch with the plain
optimizer; losses (the ranks' mean) and final variables must agree, and the
variables must be equal on every rank.
"""

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import matex.horovod.tensorflow as hvd

v1 = tf.compat.v1
COMM = MPI.COMM_WORLD
ROWS = 12   # divisible by 2 and 3: equal shards, so the mean of the ranks' losses is global

hvd.init()


def _data():
    rng = np.random.RandomState(7)
    x = rng.rand(ROWS, 4).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
         + 0.1 * rng.randn(ROWS, 1).astype(np.float32))
    return x, y


def _shard(a):
    rank, size = hvd.rank(), hvd.size()
    return a[rank * ROWS // size:(rank + 1) * ROWS // size]


def _model(offset):
    """A two-layer regression graph; initial values are ``offset`` away from the reference."""
    rng = np.random.RandomState(3)
    x = v1.placeholder(tf.float32, [None, 4], name="x")
    y = v1.placeholder(tf.float32, [None, 1], name="y")
    w1 = v1.Variable(rng.randn(4, 3).astype(np.float32) + offset, name="w1")
    b1 = v1.Variable(np.zeros(3, np.float32) + offset, name="b1")
    w2 = v1.Variable(rng.randn(3, 1).astype(np.float32) + offset, name="w2")
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) - y))
    return x, y, loss


OPTIMIZERS = {
    "gd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.05, 0.9),
    "adam": lambda: v1.train.AdamOptimizer(0.05),
}


def _train(make, distributed, steps=5, wrap=None):
    graph = tf.Graph()
    with graph.as_default():
        x, y, loss = _model(float(hvd.rank()) if distributed else 0.0)
        step = v1.train.get_or_create_global_step()
        opt = make()
        if distributed:
            opt = (wrap or hvd.DistributedOptimizer)(opt)
        train = opt.minimize(loss, global_step=step)
        # made after the gradients' allreduce, run alone with the placeholders unfed
        bcast = hvd.broadcast_global_variables(0) if distributed else None
        with v1.Session(graph=graph) as sess:
            sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            if distributed:
                sess.run(bcast)
            xs, ys = _data()
            if distributed:
                xs, ys = _shard(xs), _shard(ys)
            losses = []
            for _ in range(steps):
                value, _ = sess.run([loss, train], {x: xs, y: ys})
                losses.append(COMM.allreduce(value) / hvd.size() if distributed else value)
            names = [v.name for v in v1.global_variables()]
            values = sess.run(v1.global_variables())
            return np.array(losses), dict(zip(names, values)), opt


def _same_on_every_rank(values):
    for name, value in values.items():
        gathered = COMM.allgather(value)
        for other in gathered[1:]:
            np.testing.assert_array_equal(gathered[0], other, err_msg=name)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_v1_optimizer_matches_one_process(kind):
    losses, values, opt = _train(OPTIMIZERS[kind], True)
    ref_losses, ref_values, _ = _train(OPTIMIZERS[kind], False)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
    assert set(ref_values) <= set(values)   # (and MaTEx's byte counter)
    for name in ref_values:
        np.testing.assert_allclose(values[name], ref_values[name], rtol=2e-5, atol=1e-6,
                                   err_msg=name)
    _same_on_every_rank(values)
    assert values["global_step:0"] == 5
    assert losses[-1] < losses[0]


def test_slots_and_variables_are_the_wrapped_optimizers():
    graph = tf.Graph()
    with graph.as_default():
        x, y, loss = _model(0.0)
        inner = v1.train.AdamOptimizer(0.01)
        opt = hvd.DistributedOptimizer(inner)
        assert isinstance(opt, v1.train.Optimizer)
        opt.minimize(loss)
        assert opt.get_slot_names() == inner.get_slot_names() == ["m", "v"]
        w1 = [v for v in v1.trainable_variables() if v.name == "w1:0"][0]
        assert opt.get_slot(w1, "m") is inner.get_slot(w1, "m")
        assert opt.variables() == inner.variables() and opt.variables()


def test_var_list_and_global_step():
    graph = tf.Graph()
    with graph.as_default():
        x, y, loss = _model(0.0)
        step = v1.train.get_or_create_global_step()
        w2 = [v for v in v1.trainable_variables() if v.name == "w2:0"][0]
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.1))
        pairs = opt.compute_gradients(loss, var_list=[w2])
        assert [v for _, v in pairs] == [w2]
        train = opt.minimize(loss, global_step=step, var_list=[w2])
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run(v1.trainable_variables())
            xs, ys = _data()
            sess.run(train, {x: _shard(xs), y: _shard(ys)})
            sess.run(train, {x: _shard(xs), y: _shard(ys)})
            after = sess.run(v1.trainable_variables())
            assert sess.run(step) == 2
    # the graph's own collection (v1.trainable_variables(graph) took the graph for its
    # `scope` regex and failed once the default graph held variables)
    for v, b, a in zip(graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES), before, after):
        if v.name == "w2:0":
            assert not np.allclose(a, b)
        else:
            np.testing.assert_array_equal(a, b)
    _same_on_every_rank({"w2": after[2]})


def test_sum_op_and_fp16_compression_reduce_the_gradients():
    """op=hvd.Sum sums the ranks' gradients; fp16 compression averages within fp16 rounding."""
    size = hvd.size()
    for kwargs, expected in (({"op": hvd.Sum}, size * (size + 1) / 2),
                             ({"compression": hvd.Compression.fp16}, (size + 1) / 2)):
        graph = tf.Graph()
        with graph.as_default():
            w = v1.Variable(np.ones(3, np.float32))
            loss = tf.reduce_sum(w) * float(hvd.rank() + 1)
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(1.0), **kwargs)
            (grad, _), = opt.compute_gradients(loss)
            with v1.Session(graph=graph) as sess:
                sess.run(v1.global_variables_initializer())
                np.testing.assert_allclose(sess.run(grad), [expected] * 3, rtol=1e-3)


@pytest.mark.parametrize("passes,average", [(2, True), (3, True), (2, False)])
def test_backward_passes_per_step_accumulates_and_reduces_every_nth_call(passes, average):
    """backward_passes_per_step=N: the gradients accumulate on every call, one grouped
    reduction and one apply every N-th call, global_step counts every call (Horovod's
    semantics); after 2N calls the weights are NumPy's, equal on every rank."""
    from matex import _native

    rank, size = hvd.rank(), hvd.size()
    rng = np.random.RandomState(11)
    feeds = rng.rand(2 * passes, size, 3).astype(np.float32)   # call, rank, gradient
    w0 = np.array([1.0, -1.0, 0.5], np.float32)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [3])
        w = v1.Variable(w0)
        b = v1.Variable(np.float32(2.0))
        loss = tf.reduce_sum(w * x) + b * float(rank + 1)
        step = v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.5),
                                       backward_passes_per_step=passes,
                                       average_aggregated_gradients=average)
        train = opt.minimize(loss, global_step=step)
        core = _native.core()
        collectives, first_w = [], None
        with v1.Session(graph=graph) as sess:
            sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            for call in range(2 * passes):
                before = core.flight_sequence()
                sess.run(train, {x: feeds[call, rank]})
                collectives.append([e["site"] for e in core.flight_entries()
                                    if e["seq"] > before])
                got_w, got_b, got_step = sess.run([w, b, step])
                assert got_step == call + 1
                if (call + 1) % passes:   # no apply on the other calls
                    expected_w = w0 if call < passes else first_w
                    np.testing.assert_array_equal(got_w, expected_w)
                elif call + 1 == passes:
                    first_w = got_w
    divisor = passes if average else 1
    expected_w, expected_b = w0.astype(np.float64), 2.0
    for window in range(2):
        calls = feeds[window * passes:(window + 1) * passes]
        expected_w = expected_w - 0.5 * calls.sum(axis=0).mean(axis=0) / divisor
        expected_b -= 0.5 * passes * np.mean(np.arange(1, size + 1)) / divisor
    np.testing.assert_allclose(got_w, expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, expected_b, rtol=1e-5, atol=1e-6)
    _same_on_every_rank({"w": got_w, "b": got_b})
    # one reduction (the fused gradients' kernels, all in the v2 cond) on each N-th call,
    # the same each time; no collective on the other calls
    reduction = collectives[passes - 1]
    assert reduction and all(site.startswith("cond/") for site in reduction), collectives
    assert collectives == [reduction if (c + 1) % passes == 0 else []
                           for c in range(2 * passes)], collectives


def test_backward_passes_per_step_with_another_collective_in_the_run_is_a_clear_error():
    """The reduction's v2 cond and another MaTEx collective in one Session.run cannot be
    ordered across ranks: the scheduler refuses the run on every rank, before it starts."""
    graph = tf.Graph()
    with graph.as_default():
        w = v1.Variable(np.ones(2, np.float32))
        loss = tf.reduce_sum(w) * float(hvd.rank() + 1)
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.1),
                                       backward_passes_per_step=2)
        train = opt.minimize(loss)
        other = hvd.allreduce(tf.constant([1.0]))
        with v1.Session(graph=graph) as sess:
            sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            with pytest.raises(tf.errors.UnimplementedError, match="control flow v2"):
                sess.run([train, other])
            sess.run(train)   # alone it runs, then the other collective alone
            sess.run(train)
            np.testing.assert_allclose(sess.run(other), [1.0])
            np.testing.assert_allclose(sess.run(w), 1.0 - 0.1 * (hvd.size() + 1), rtol=1e-6)


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_backward_passes_per_step_with_slot_optimizers_matches_one_process(kind):
    """The same batch on both calls of a window (no apply in between): the averaged
    accumulated gradient is one step's, so 2k calls with N=2 equal k plain steps in one
    process; the wrapped optimizer's slots are made (and applied) through the cond."""
    def wrap(opt):
        return hvd.DistributedOptimizer(opt, backward_passes_per_step=2,
                                        average_aggregated_gradients=True)

    losses, values, _ = _train(OPTIMIZERS[kind], True, steps=6, wrap=wrap)
    ref_losses, ref_values, _ = _train(OPTIMIZERS[kind], False, steps=3)
    np.testing.assert_allclose(losses[::2], ref_losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(losses[1::2], losses[::2], rtol=1e-6)
    for name in ref_values:
        if name != "global_step:0":
            np.testing.assert_allclose(values[name], ref_values[name], rtol=2e-5, atol=1e-6,
                                       err_msg=name)
    assert values["global_step:0"] == 6 and ref_values["global_step:0"] == 3
    _same_on_every_rank(values)


def test_collectives_inside_a_graph():
    rank, size = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        t = v1.placeholder(tf.float32, [None])
        summed = hvd.allreduce(t, op=hvd.Sum)
        averaged = hvd.allreduce(t)
        gathered = hvd.allgather(t)
        broadcast = hvd.broadcast(t, root_rank=size - 1)
        with v1.Session(graph=graph) as sess:
            out = sess.run([summed, averaged, gathered, broadcast],
                           {t: np.full(2, rank + 1.0, np.float32)})
    total = size * (size + 1) / 2
    np.testing.assert_allclose(out[0], [total] * 2)
    np.testing.assert_allclose(out[1], [total / size] * 2)
    np.testing.assert_allclose(out[2], np.repeat(np.arange(1.0, size + 1), 2))
    np.testing.assert_allclose(out[3], [float(size)] * 2)


def test_mixed_precision_graph_rewrite_composes():
    """enable_mixed_precision_graph_rewrite wraps our optimizer in a loss-scale optimizer
    (TensorFlow 2.21 still offers it; on CPU the rewrite itself changes no op)."""
    wrap = v1.mixed_precision.enable_mixed_precision_graph_rewrite
    try:
        def make_wrapped(opt):
            return wrap(hvd.DistributedOptimizer(opt), loss_scale=128.0)

        losses, values, opt = _train(OPTIMIZERS["gd"], True, wrap=make_wrapped)
    finally:
        v1.mixed_precision.disable_mixed_precision_graph_rewrite()
    assert isinstance(opt, v1.mixed_precision.MixedPrecisionLossScaleOptimizer)
    ref_losses, ref_values, _ = _train(OPTIMIZERS["gd"], False)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
    for name in ref_values:
        np.testing.assert_allclose(values[name], ref_values[name], rtol=2e-5, atol=1e-6)
    _same_on_every_rank(values)


def test_process_set_averages_over_its_members_only():
    """process_set={0,1} on 3 ranks: ranks 0 and 1 get the mean of their gradients, rank 2
    keeps its own (Horovod's process_set=)."""
    rank, size = hvd.rank(), hvd.size()
    if size < 3:
        pytest.skip("a proper subset of the ranks needs 3 ranks")
    pset = hvd.add_process_set([0, 1])
    try:
        graph = tf.Graph()
        with graph.as_default():
            w = v1.Variable(np.ones(3, np.float32))
            factor = np.array([1.0, 2.0, -1.0], np.float32) * (rank + 1)
            loss = tf.reduce_sum(w * factor)
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(0.5),
                                           process_set=pset)
            (grad, _), = opt.compute_gradients(loss)
            train = opt.apply_gradients([(grad, w)])
            with v1.Session(graph=graph) as sess:
                sess.run(v1.global_variables_initializer())
                got = sess.run(grad)
                sess.run(train)
                weights = sess.run(w)
        base = np.array([1.0, 2.0, -1.0], np.float32)
        expected = base * (1 + 2) / 2 if rank in (0, 1) else base * (rank + 1)
        np.testing.assert_allclose(got, expected, rtol=1e-6)
        np.testing.assert_allclose(weights, 1.0 - 0.5 * expected, rtol=1e-6)
    finally:
        hvd.remove_process_set(pset)


def test_sparse_as_dense_makes_the_embedding_gradient_dense_and_averages_it():
    """An embedding lookup's IndexedSlices gradient becomes a dense tensor, averaged."""
    rank, size = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        table = v1.Variable(np.zeros((5, 2), np.float32))
        ids = tf.constant([rank % 5, (rank + 2) % 5, 4], tf.int32)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids)) * float(rank + 1)
        plain = v1.train.GradientDescentOptimizer(1.0).compute_gradients(loss, [table])[0][0]
        assert isinstance(plain, tf.IndexedSlices)
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(1.0),
                                       sparse_as_dense=True)
        (grad, _), = opt.compute_gradients(loss, [table])
        assert isinstance(grad, tf.Tensor) and not isinstance(grad, tf.IndexedSlices)
        train = opt.apply_gradients([(grad, table)])
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            got = sess.run(grad)
            sess.run(train)
            weights = sess.run(table)
    expected = np.zeros((5, 2), np.float32)
    for r in range(size):
        for i in (r % 5, (r + 2) % 5, 4):
            expected[i] += (r + 1) / size
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(weights, -expected, rtol=1e-6)
    _same_on_every_rank({"table": weights})
