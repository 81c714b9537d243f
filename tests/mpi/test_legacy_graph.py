"""TF1 graphs in a Session: each MaTEx collective runs when fetched, and only then; the
collectives of one run pair correctly whatever order each rank fetches them in; ranks that
fetch different collectives get one error each (launched by tests/test_legacy_graph.py)."""

import os

import numpy as np
import pytest
import tensorflow as tf

import matex
from matex import _native
from matex.legacy import _schedule, _session

HOOKED_AT_IMPORT = _schedule.HOOK_NAME in _session.run_hooks()   # before any graph is built
R, N = matex.rank(), matex.size()
FEED = {"rows": 4}


def sites(session, fetches, feed_dict=None):
    """``(result, names of the MaTEx kernels that ran collectives in this run)``."""
    core = _native.core()
    before = core.flight_sequence()
    result = session.run(fetches, feed_dict)
    ran = [e["site"] for e in core.flight_entries() if e["seq"] > before]
    return result, ran


def training_graph():
    """A TF1 training graph (placeholders, averaged gradients, v1 optimizer), then a
    broadcast of its variables made after the update, as Horovod's scripts do."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        w = tf.compat.v1.get_variable("w", initializer=tf.fill([3, 1], float(R + 1)))
        b = tf.compat.v1.get_variable("b", initializer=tf.fill([1], float(-R)))
        pred = tf.identity(tf.matmul(x, w) + b, name="pred")
        loss = tf.reduce_mean(tf.square(pred - y))
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        grads = opt.compute_gradients(loss, [w, b])
        grads = [(matex.allreduce(gr, op="average"), v) for gr, v in grads]
        train = opt.apply_gradients(grads)
        bcast = tf.group(*[v.assign(matex.broadcast(v, 0)) for v in (w, b)])
        init = tf.compat.v1.global_variables_initializer()
    return g, dict(x=x, y=y, w=w, b=b, pred=pred, loss=loss, train=train, bcast=bcast,
                   init=init, grads=[gr for gr, _ in grads])


def batch(step):
    rng = np.random.default_rng(100 * step + R)
    return rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(4, 1)).astype("float32")


def test_broadcast_runs_alone_after_the_initialiser_with_placeholders_unfed():
    g, t = training_graph()
    with tf.compat.v1.Session(graph=g) as s:
        s.run(t["init"])
        _, ran = sites(s, t["bcast"])   # nothing fed: the gradients' allreduces must not run
        assert sorted(ran) == sorted(op.name for op in g.get_operations()
                                     if op.type == "MatexBroadcast"), ran
        w, b = s.run([t["w"], t["b"]])
        np.testing.assert_array_equal(w, np.full([3, 1], 1.0))
        np.testing.assert_array_equal(b, np.zeros([1]))
        for step in range(3):
            x, y = batch(step)
            s.run(t["train"], {t["x"]: x, t["y"]: y})
        everyone = matex.allgather_object(s.run([t["w"], t["b"]]))
    for other in everyone:
        np.testing.assert_array_equal(other[0], everyone[0][0])
        np.testing.assert_array_equal(other[1], everyone[0][1])


def test_a_step_run_repeatedly_runs_only_the_transfers_it_fetches():
    g, t = training_graph()
    grads = sorted(gr.op.name for gr in t["grads"])
    with tf.compat.v1.Session(graph=g) as s:
        s.run(t["init"])
        s.run(t["bcast"])
        for step in range(4):
            x, y = batch(step)
            _, ran = sites(s, t["train"], {t["x"]: x, t["y"]: y})
            assert sorted(ran) == grads, ran   # never the broadcast again
        _, ran = sites(s, t["pred"], {t["x"]: x})   # inference: no collective at all
        assert ran == []


def independent(count=8):
    g = tf.Graph()
    with g.as_default():
        outs = [matex.allreduce(tf.fill([i + 2], float(i * 10 + R)), op="sum")
                for i in range(count)]
        gathered = matex.allgather(tf.fill([R + 1, 2], float(R)))
    return g, outs, gathered


def expected(i):
    return np.full(i + 2, float(sum(i * 10 + r for r in range(N))))


@pytest.mark.parametrize("threads", [0, 1])
def test_independent_collectives_fetched_in_different_orders_pair_correctly(threads):
    """Each rank fetches the same collectives in its own order (reversed on odd ranks,
    rotated by rank), with one inter-op thread (a kernel waiting for its turn must not
    hold it) or TensorFlow's default pool."""
    g, outs, gathered = independent()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
    with tf.compat.v1.Session(graph=g, config=config) as s:
        for trial in range(6):
            order = list(range(len(outs)))
            order = order[R:] + order[:R]
            if (R + trial) % 2:
                order.reverse()
            got = s.run({"outs": [outs[i] for i in order], "gathered": gathered})
            for i, v in zip(order, got["outs"]):
                np.testing.assert_array_equal(v, expected(i))
            np.testing.assert_array_equal(got["gathered"], np.concatenate(
                [np.full([r + 1, 2], float(r)) for r in range(N)]))
            # a subset, in a rank-dependent order: only those run
            pick = [3, 1] if R % 2 else [1, 3]
            (a, b), ran = sites(s, [outs[i] for i in pick])
            np.testing.assert_array_equal(a, expected(pick[0]))
            np.testing.assert_array_equal(b, expected(pick[1]))
            assert sorted(ran) == sorted(outs[i].op.name for i in pick)


def test_collectives_and_their_gradients_in_one_run():
    """A collective whose input is another collective's output runs after it on every rank."""
    g = tf.Graph()
    with g.as_default():
        xs = [tf.fill([4], float(i * 10 + R)) for i in range(4)]
        outs = [matex.allreduce(x, op="sum") for x in xs]
        chained = matex.allreduce(outs[0] * 2.0, op="sum")
        loss = tf.add_n([tf.reduce_sum(o * (i + 1)) for i, o in enumerate(outs)])
        grads = tf.compat.v1.gradients(loss, xs)
    with tf.compat.v1.Session(graph=g) as s:
        fetch = [grads, chained] if R % 2 else [chained, grads]
        got = s.run(fetch)
        got_grads, got_chained = (got[0], got[1]) if R % 2 else (got[1], got[0])
    for i, gr in enumerate(got_grads):
        np.testing.assert_array_equal(gr, np.full(4, (i + 1) * N))
    np.testing.assert_array_equal(got_chained, np.full(4, 2.0 * N * sum(range(N))))


def test_ranks_fetching_different_collectives_get_one_error_each():
    g, outs, _ = independent(4)
    with tf.compat.v1.Session(graph=g) as s:
        # same shapes and dtypes would pair silently: the run's schedule is agreed first
        with pytest.raises(tf.errors.InvalidArgumentError, match="fetch different MaTEx"):
            s.run(outs[0] if R == 0 else outs[1])
        # one rank fetches one more
        with pytest.raises(tf.errors.InvalidArgumentError, match="rank 0: 2 collectives"):
            s.run(outs[:2] if R == 0 else outs[:1])
        # and everyone is still in step
        np.testing.assert_array_equal(s.run(outs[2]), expected(2))


def test_horovod_mismatch_code_is_kept():
    from matex import _collectives

    g = tf.Graph()
    with g.as_default(), _collectives.mismatch_code(tf.errors.FAILED_PRECONDITION):
        a = matex.allreduce(tf.ones([2]), op="sum")
        b = matex.allreduce(tf.ones([2]), op="sum")
    with tf.compat.v1.Session(graph=g) as s:
        with pytest.raises(tf.errors.FailedPreconditionError, match="fetch different"):
            s.run(a if R == 0 else b)
        np.testing.assert_array_equal(s.run(b), np.full(2, float(N)))


def test_v1_control_flow_refuses_a_collective_at_construction():
    tf.compat.v1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            p = tf.compat.v1.placeholder(tf.bool, [])
            with pytest.raises(NotImplementedError, match="cond / while_loop"):
                tf.compat.v1.cond(p, lambda: matex.allreduce(tf.ones([2])), lambda: tf.ones([2]))
    finally:
        tf.compat.v1.enable_control_flow_v2()


def test_control_flow_v2_alone_runs_and_mixed_is_one_error():
    g = tf.Graph()
    with g.as_default():
        p = tf.compat.v1.placeholder(tf.bool, [])
        inside = tf.compat.v1.cond(p, lambda: matex.allreduce(tf.fill([2], float(R)), op="sum"),
                                   lambda: tf.zeros([2]))
        outside = matex.allreduce(tf.ones([3]), op="sum")
    with tf.compat.v1.Session(graph=g) as s:
        np.testing.assert_array_equal(s.run(inside, {p: True}),
                                      np.full(2, float(sum(range(N)))))
        np.testing.assert_array_equal(s.run(outside), np.full(3, float(N)))
        with pytest.raises(tf.errors.UnimplementedError, match="control flow v2"):
            s.run([inside, outside], {p: True})
        np.testing.assert_array_equal(s.run(outside), np.full(3, float(N)))


def test_plans_are_cached_per_fetches_and_feeds():
    g, outs, _ = independent(2)
    with tf.compat.v1.Session(graph=g) as s:
        before = dict(_schedule.stats)
        for _ in range(5):
            s.run(outs)
        assert _schedule.stats["plans"] - before["plans"] == 1
        assert _schedule.stats["scheduled"] - before["scheduled"] == 5


def test_export_a_trained_meta_graph_for_a_plain_process():
    """Rank 0 writes the trained graph's checkpoint and meta graph where the launcher
    asked (MATEX_TEST_EXPORT_DIR); tests/test_legacy_graph.py imports it in a plain process."""
    directory = os.environ.get("MATEX_TEST_EXPORT_DIR")
    if not directory:
        pytest.skip("no export directory (run by tests/test_legacy_graph.py)")
    g, t = training_graph()
    with g.as_default():
        saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session(graph=g) as s:
        s.run(t["init"])
        s.run(t["bcast"])
        for step in range(3):
            x, y = batch(step)
            s.run(t["train"], {t["x"]: x, t["y"]: y})
        probe = np.arange(6, dtype="float32").reshape(2, 3)
        predicted = s.run(t["pred"], {t["x"]: probe})
        if R == 0:
            saver.save(s, os.path.join(directory, "model"))
            np.save(os.path.join(directory, "predicted.npy"), predicted)
    matex.allgather_object(0)   # written before any rank leaves


def test_an_op_failing_before_its_collective_ends_the_run_on_every_rank():
    """The first collective's input fails (on every rank) while a later one is queued for
    its turn: the run ends with the failure, the queued collective is withdrawn (no hang)."""
    g = tf.Graph()
    with g.as_default():
        bad = tf.debugging.check_numerics(tf.math.log(-tf.ones([2])), "boom")
        first = matex.allreduce(bad, op="sum")
        second = matex.allreduce(tf.ones([3]), op="sum")
    with tf.compat.v1.Session(graph=g) as s:
        for _ in range(3):
            with pytest.raises(tf.errors.InvalidArgumentError, match="boom"):
                s.run([second, first])
        np.testing.assert_array_equal(s.run(second), np.full(3, float(N)))


def test_a_shape_mismatch_inside_a_scheduled_collective_is_one_error_on_every_rank():
    """Same collectives fetched, different shapes on some rank: the kernel's agreement check
    reports it from the turnstile's thread as an error of the run (Horovod's code kept)."""
    from matex import _collectives

    g = tf.Graph()
    with g.as_default():
        queued = matex.allreduce(tf.ones([2]), op="sum")   # created first: runs first
        odd = matex.allreduce(tf.ones([2 + (R == N - 1)]), op="sum")
        with _collectives.mismatch_code(tf.errors.FAILED_PRECONDITION):
            odd_hvd = matex.allreduce(tf.ones([1 + (R == 0)]), op="sum")
    with tf.compat.v1.Session(graph=g) as s:
        with pytest.raises(tf.errors.InvalidArgumentError, match="ranks disagree"):
            s.run([odd, queued])
        with pytest.raises(tf.errors.FailedPreconditionError, match="ranks disagree"):
            s.run(odd_hvd)
        np.testing.assert_array_equal(s.run(queued), np.full(2, float(N)))


def test_an_imported_graph_is_scheduled_too():
    """A GraphDef made elsewhere (a meta graph, a frozen graph) keeps its ops' numbers; an
    MPI job schedules it although it made no MaTEx op itself (hook installed at import)."""
    assert HOOKED_AT_IMPORT
    source, outs, _ = independent(6)
    names = [o.name for o in outs]
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(source.as_graph_def(), name="")
    with tf.compat.v1.Session(graph=g) as s:
        for trial in range(4):
            order = list(range(len(names)))
            if (R + trial) % 2:
                order.reverse()
            got = s.run([names[i] for i in order])
            for i, v in zip(order, got):
                np.testing.assert_array_equal(v, expected(i))


def test_the_scheduler_plans_what_an_outer_hook_hands_on():
    """Another Session.run hook (the unmodified-script path's) may add fetches: the
    scheduler runs innermost, so a collective added there is scheduled too."""
    g, outs, _ = independent(3)

    def outer(run, session, fetches, feed_dict, options, run_metadata):
        if session.graph is not g:
            return run(fetches, feed_dict, options, run_metadata)
        return run([fetches, outs[2]], feed_dict, options, run_metadata)[0]

    _session.add_run_hook("test.outer", outer)
    try:
        assert _session.run_hooks()[-1] == _schedule.HOOK_NAME
        with tf.compat.v1.Session(graph=g) as s:
            got, ran = sites(s, outs[0])
            np.testing.assert_array_equal(got, expected(0))
    finally:
        _session.remove_run_hook("test.outer")
    assert sorted(ran) == sorted([outs[0].op.name, outs[2].op.name])
