"""Every collective x dtype x reduce op against NumPy, eager and in tf.function."""

import os
import time

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import matex
from matex import _collectives, _fusion, _native, _runtime

R, N = matex.rank(), matex.size()
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
OPS = ["sum", "average", "min", "max"]
MODES = ["eager", "function"]


def np_dtype(dtype):
    return ml_dtypes.bfloat16 if dtype == tf.bfloat16 else dtype.as_numpy_dtype


def rank_values(r, shape, dtype):
    """Rank r's input: small integers, exact in every dtype."""
    rng = np.random.default_rng(1000 + r)
    return rng.integers(-20, 21, size=shape).astype(np.float64)


def expected_reduce(op, shape, dtype):
    stack = np.stack([rank_values(r, shape, dtype) for r in range(N)])
    if op == "sum":
        return stack.sum(0)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    if dtype.is_integer:
        return np.trunc(stack.sum(0) / N)   # C division truncates toward zero
    return stack.sum(0) / N


def run(mode, fn, *args):
    if mode == "function":
        return tf.function(fn)(*args)
    return fn(*args)


def tolerance(dtype):
    return {tf.float16: 1e-3, tf.bfloat16: 1e-2, tf.float32: 1e-6}.get(dtype, 1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce(dtype, op, mode):
    shape = (3, 5)
    x = tf.constant(rank_values(R, shape, dtype).astype(np_dtype(dtype)))
    got = run(mode, lambda t: matex.allreduce(t, op=op), x)
    assert got.dtype == dtype and got.shape == shape
    want = expected_reduce(op, shape, dtype)
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=tolerance(dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_grouped_allreduce(dtype, mode):
    shapes = [(4,), (2, 3), (1,), (5, 1, 2)]
    xs = [tf.constant(rank_values(R + 7 * i, s, dtype).astype(np_dtype(dtype)))
          for i, s in enumerate(shapes)]
    got = run(mode, lambda *ts: _collectives.grouped_allreduce(list(ts), op="sum"), *xs)
    for i, (g, s) in enumerate(zip(got, shapes)):
        want = sum(rank_values(r + 7 * i, s, dtype) for r in range(N))
        np.testing.assert_allclose(g.numpy().astype(np.float64), want, rtol=tolerance(dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast(dtype, root, mode):
    root = 0 if root == "first" else N - 1
    x = tf.constant(rank_values(R, (2, 3), dtype).astype(np_dtype(dtype)))
    got = run(mode, lambda t: matex.broadcast(t, root=root), x)
    np.testing.assert_array_equal(got.numpy().astype(np.float64),
                                  rank_values(root, (2, 3), dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allgather_uneven_first_dims(dtype, mode):
    # rank r contributes r+1 rows (rank 0 one row, ...); rows are all distinct
    x = tf.constant(rank_values(R, (R + 1, 2, 2), dtype).astype(np_dtype(dtype)))
    got = run(mode, matex.allgather, x)
    want = np.concatenate([rank_values(r, (r + 1, 2, 2), dtype) for r in range(N)])
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy().astype(np.float64), want)


def test_allgather_empty_rank():
    x = tf.ones([0 if R == 0 else 2, 3])
    got = matex.allgather(x)
    assert got.shape == (2 * (N - 1), 3)


@pytest.mark.parametrize("mode", MODES)
def test_large_outputs_held_by_the_caller_are_never_overwritten(mode):
    # Results still held must keep their values through later calls of the
    # same kernels (whose inputs TensorFlow may forward, and whose dropped
    # outputs' memory it reuses).
    n = 1 << 15   # 128 KB of float32

    def four_calls(a, b):
        return (matex.allreduce(a, "sum"), matex.allreduce(b, "sum"),
                matex.broadcast(a, root=N - 1), matex.broadcast(b, root=0))

    inputs = [tf.fill([n], float(R + k)) for k in (1, 100)]
    fn = tf.function(four_calls) if mode == "function" else four_calls
    held = [fn(*inputs) for _ in range(3)]   # the same kernels run three times
    dropped = None
    for _ in range(3):
        dropped = fn(*inputs)   # results dropped: their buffers may be reused
    del dropped
    total = sum(range(N))
    for sums_a, sums_b, root_a, root_b in held + [fn(*inputs)]:
        np.testing.assert_array_equal(sums_a.numpy(), np.full(n, total + N))
        np.testing.assert_array_equal(sums_b.numpy(), np.full(n, total + 100 * N))
        np.testing.assert_array_equal(root_a.numpy(), np.full(n, N))
        np.testing.assert_array_equal(root_b.numpy(), np.full(n, 100))


def _vm_flags(address):
    """The VmFlags of this process's mapping that holds ``address``."""
    flags, inside = None, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    return flags


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(not os.path.exists(THP) or "[never]" in open(THP).read(),
                    reason="no transparent huge pages on this kernel")
@pytest.mark.parametrize("what", ["allreduce", "allgather"])
def test_large_outputs_ask_for_huge_pages(what):
    # MPI writes large outputs whole on every call: 4 KB pages cost TLB misses
    # (NumPy asks huge pages for its large arrays; the benchmark's reference).
    n = 3 << 20   # 12 MB of float32: at least one whole 2 MB page inside
    if what == "allreduce":
        out = matex.allreduce(tf.fill([n], float(R)), "sum")
        expected = np.full(n, float(sum(range(N))))
    else:
        out = matex.allgather(tf.fill([n // N], float(R)))
        expected = np.repeat(np.arange(N, dtype=np.float32), n // N)
    np.testing.assert_array_equal(out.numpy(), expected)
    start = np.from_dlpack(out).ctypes.data
    middle = (start + (4 << 20)) & ~((2 << 20) - 1)   # a huge-page boundary inside it
    assert "hg" in _vm_flags(middle)


def test_allreduce_gradient_sum_and_average():
    x = tf.Variable(rank_values(R, (4,), tf.float32).astype(np.float32))
    with tf.GradientTape(persistent=True) as tape:
        s = tf.reduce_sum(matex.allreduce(x, "sum") * (R + 1.0))
        a = tf.reduce_sum(matex.allreduce(x, "average") * (R + 1.0))
    # d/dx_r of sum_r' (r'+1) * sum(allreduce) = sum_r' (r'+1) on every rank
    total = sum(r + 1.0 for r in range(N))
    np.testing.assert_allclose(tape.gradient(s, x).numpy(), np.full(4, total))
    np.testing.assert_allclose(tape.gradient(a, x).numpy(), np.full(4, total / N), rtol=1e-6)


def test_allreduce_gradient_max_goes_to_argmax_rank():
    x = tf.Variable([float(R), float(-R)])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(matex.allreduce(x, "max"))
    g = tape.gradient(y, x).numpy()
    # element 0: max held by the last rank; element 1: by rank 0; N ranks each add 1
    np.testing.assert_array_equal(g, [N if R == N - 1 else 0, N if R == 0 else 0])


def test_broadcast_gradient_goes_to_root():
    root = N - 1
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(matex.broadcast(x, root=root) * (R + 1.0))
    g = tape.gradient(y, x).numpy()
    total = sum(r + 1.0 for r in range(N))
    np.testing.assert_allclose(g, [total, total] if R == root else [0.0, 0.0])


@pytest.mark.parametrize("mode", MODES)
def test_allgather_gradient(mode):
    x = tf.Variable(np.full((R + 1, 2), R + 1.0, np.float32))

    def grad():
        with tf.GradientTape() as tape:
            g = matex.allgather(x)
            y = tf.reduce_sum(g * g)
        return tape.gradient(y, x)

    got = run(mode, grad).numpy()
    # y = sum of squares of all rows, identical on all N ranks; d/dx_r = N * 2 * x_r
    np.testing.assert_allclose(got, N * 2.0 * (R + 1.0) * np.ones((R + 1, 2)))


@pytest.mark.parametrize("what", ["shape", "dtype", "op"])
def test_mismatch_fails_on_every_rank_quickly(what):
    started = time.time()
    if what == "shape":
        x, op = tf.ones([R + 2]), "sum"
    elif what == "dtype":
        x, op = tf.ones([3], tf.float32 if R == 0 else tf.float64), "sum"
    else:
        x, op = tf.ones([3]), "sum" if R == 0 else "max"
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        matex.allreduce(x, op=op)
    assert time.time() - started < 10
    message = str(info.value)
    assert "ranks disagree" in message
    assert matex.errors.is_mismatch(info.value)            # by payload, not by text
    assert not matex.errors.is_rank_failure(info.value)
    for r in range(N):
        assert "rank %d:" % r in message
    # the communicator is still usable afterwards
    assert float(matex.allreduce(tf.constant(1.0), "sum")) == N


@pytest.mark.parametrize("how", ["dynamic shape", "static shapes, one call skipped"])
def test_mismatch_after_many_agreeing_executions_is_caught(how):
    # The check runs at every execution of a traced collective, not only at
    # its first ones: after 20 agreeing steps, a dynamic dimension that
    # differs, or one rank skipping a call (its data ended a step early, so
    # its metric reduction meets the others' gradient reduction), is still a
    # MismatchError on every rank, never a hang or wrong sums.
    started = time.time()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def gradients(x):
        return matex.allreduce(x, op="sum")

    @tf.function
    def metric(x):
        return matex.allreduce(x, op="average")

    for _ in range(20):
        assert float(gradients(tf.ones([8]))[0]) == N
        assert float(metric(tf.ones([2]))[0]) == 1.0
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        if how == "dynamic shape":
            gradients(tf.ones([8 + (R == 0)]))
        elif R == 0:
            metric(tf.ones([2]))
        else:
            gradients(tf.ones([8]))
    assert matex.errors.is_mismatch(info.value)
    assert time.time() - started < 30
    for r in range(N):
        assert "rank %d:" % r in str(info.value)
    assert float(matex.allreduce(tf.constant(1.0), "sum")) == N


def test_broadcast_shape_mismatch_fails_everywhere():
    with pytest.raises(tf.errors.InvalidArgumentError, match="broadcast"):
        matex.broadcast(tf.ones([2 + (R == 0)]), root=0)


def test_bad_root_and_bad_op_and_dtype():
    with pytest.raises(tf.errors.InternalError, match="root"):
        matex.broadcast(tf.ones([2]), root=N)
    with pytest.raises(ValueError, match="op must be one of"):
        matex.allreduce(tf.ones([2]), op="mean")
    with pytest.raises(TypeError, match="does not support dtype uint32"):
        matex.allreduce(tf.ones([2], tf.uint32))


# ---- alltoall, reducescatter, product, small integer and bool dtypes (#25) ----

SMALL = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.bool]
ALL_DTYPES = DTYPES + SMALL


def small_values(r, shape, dtype):
    """Rank r's input for the exact checks: 0..3 (0/1 for bool), wrap-free in every dtype."""
    rng = np.random.default_rng(2000 + r)
    high = 2 if dtype == tf.bool else 4
    return rng.integers(0, high, size=shape).astype(np_dtype(dtype))


def np_reduce(op, stack, dtype):
    """NumPy's reduction over axis 0 in `dtype` (small integers wrap as C's do)."""
    d = np_dtype(dtype)
    if op == "sum":
        return stack.sum(0, dtype=d)
    if op == "average":
        total = stack.sum(0, dtype=d).astype(np.float64)
        return (np.trunc(total / N) if dtype.is_integer else total / N).astype(d)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    return stack.prod(0, dtype=d)


def assert_reduced(got, want, dtype, what):
    """Integers and bools exactly; floats to their precision."""
    if dtype.is_floating:
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.astype(np.float64),
                                   rtol=tolerance(dtype), err_msg=what)
    else:
        np.testing.assert_array_equal(got.numpy(), want, err_msg=what)


def ops_for(dtype):
    return ["min", "max", "product"] if dtype == tf.bool else OPS + ["product"]


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_product_and_small_dtypes(mode):
    # the new dtypes with every op they take, and product for every dtype (one trace)
    ops = [ops_for(d) if d in SMALL else ["product"] for d in ALL_DTYPES]
    xs = [tf.constant(small_values(R, (3, 4), d)) for d in ALL_DTYPES]

    def reduce_all(*ts):
        return [([matex.allreduce(t, op=op) for op in o],
                 _collectives.grouped_allreduce([t, t[0]], op="product")[1])
                for t, o in zip(ts, ops)]

    for dtype, o, (got, grouped) in zip(ALL_DTYPES, ops, run(mode, reduce_all, *xs)):
        stack = np.stack([small_values(r, (3, 4), dtype) for r in range(N)])
        for op, g in zip(o, got):
            assert g.dtype == dtype, (dtype, op)
            assert_reduced(g, np_reduce(op, stack, dtype), dtype, "%s %s" % (dtype.name, op))
        assert_reduced(grouped, np_reduce("product", stack, dtype)[0], dtype, dtype.name)


@pytest.mark.parametrize("length", [2, 256], ids=["short", "long"])
def test_small_integers_wrap_as_c_does(length):
    """A sum or product of 8/16-bit integers wraps, an average is the exact truncated mean,
    for vectors long enough for Open MPI's AVX code too (which saturates their sums)."""
    for dtype, value in ((tf.int8, 100), (tf.uint8, 200), (tf.int16, 30000), (tf.uint16, 60000)):
        mine = np.resize(np.array([value, -value if dtype.min < 0 else 3, 7]) + R, length)
        stack = np.stack([np.resize(np.array([value, -value if dtype.min < 0 else 3, 7]) + r,
                                    length) for r in range(N)]).astype(np.int64)
        x = tf.constant(mine.astype(dtype.as_numpy_dtype))
        wrap = dtype.as_numpy_dtype
        for op, want in (("sum", stack.sum(0).astype(wrap)),
                         ("product", np.prod(stack, 0).astype(wrap)),
                         ("average", np.trunc(stack.sum(0) / N).astype(wrap))):
            got = matex.allreduce(x, op)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.numpy(), want, err_msg="%s %s" % (dtype.name, op))
            grouped = _collectives.grouped_allreduce([x, tf.constant([1], tf.int32)], op=op)
            np.testing.assert_array_equal(grouped[0].numpy(), want, err_msg=dtype.name)
        rows = matex.reducescatter(np.tile(mine.astype(wrap), (N, 1)), op="sum")
        np.testing.assert_array_equal(rows.numpy()[0], stack.sum(0).astype(wrap),
                                      err_msg=dtype.name)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_and_allgather_of_small_dtypes(mode):
    xs = [tf.constant(small_values(R, (R + 1, 3), d)) for d in SMALL]
    got = run(mode, lambda *ts: [(matex.broadcast(t[:1], root=N - 1), matex.allgather(t))
                                 for t in ts], *xs)
    for dtype, (b, g) in zip(SMALL, got):
        assert b.dtype == g.dtype == dtype
        np.testing.assert_array_equal(b.numpy(), small_values(N - 1, (N, 3), dtype)[:1])
        np.testing.assert_array_equal(
            g.numpy(), np.concatenate([small_values(r, (r + 1, 3), dtype) for r in range(N)]))


def a2a_splits(r):
    """Rank r's splits: uneven, with zeros (some rank sends some rank nothing)."""
    return [(r + 2 * j) % 3 for j in range(N)]


def a2a_input(r, dtype, width=2):
    rows = sum(a2a_splits(r))
    vals = (np.arange(rows * width).reshape(rows, width) + 20 * r) % 64
    if dtype == tf.bool:
        vals = vals % 2
    return vals.astype(np_dtype(dtype))


def a2a_expected(dest, dtype, width=2):
    parts = []
    for r in range(N):
        s = a2a_splits(r)
        off = sum(s[:dest])
        parts.append(a2a_input(r, dtype, width)[off:off + s[dest]])
    return np.concatenate(parts), [a2a_splits(r)[dest] for r in range(N)]


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_uneven_splits_every_dtype(mode):
    xs = [tf.constant(a2a_input(R, d)) for d in ALL_DTYPES]
    got = run(mode, lambda *ts: [matex.alltoall(t, a2a_splits(R)) for t in ts], *xs)
    for dtype, (out, received) in zip(ALL_DTYPES, got):
        want, want_splits = a2a_expected(R, dtype)
        assert out.dtype == dtype and received.dtype == tf.int32
        assert out.shape == want.shape, (dtype, out.shape, want.shape)
        np.testing.assert_array_equal(out.numpy(), want, err_msg=dtype.name)
        assert received.numpy().tolist() == want_splits


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_equal_split_and_empty(mode):
    # None: equal parts; rank r's k-th part goes to rank k
    x = tf.constant(np.arange(2 * N * 6, dtype=np.float32).reshape(2 * N, 3, 2) + 1000 * R)
    out, received = run(mode, matex.alltoall, x)
    want = np.concatenate([np.arange(2 * N * 6, dtype=np.float32).reshape(2 * N, 3, 2)
                           [2 * R:2 * R + 2] + 1000 * r for r in range(N)])
    np.testing.assert_array_equal(out.numpy(), want)
    assert received.numpy().tolist() == [2] * N
    out, received = run(mode, matex.alltoall, tf.zeros([0, 4], tf.int16))
    assert out.shape == (0, 4) and received.numpy().tolist() == [0] * N


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_every_dtype_and_op_uneven_rows(mode):
    rows = 2 * N + 1        # rank 0 gets 3 rows, the others 2 (Horovod's split)
    q, m = divmod(rows, N)
    lo = R * q + min(R, m)
    hi = lo + q + (R < m)
    xs = [tf.constant(small_values(R, (rows, 2), d)) for d in ALL_DTYPES]

    def scatter_all(*ts):
        return [[matex.reducescatter(t, op=op) for op in ops_for(d)]
                for t, d in zip(ts, ALL_DTYPES)]

    for dtype, got in zip(ALL_DTYPES, run(mode, scatter_all, *xs)):
        stack = np.stack([small_values(r, (rows, 2), dtype) for r in range(N)])
        for op, g in zip(ops_for(dtype), got):
            assert g.dtype == dtype and g.shape == (hi - lo, 2), (dtype, op, g.shape)
            assert_reduced(g, np_reduce(op, stack, dtype)[lo:hi], dtype,
                           "%s %s" % (dtype.name, op))


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_pre_and_postscale(mode):
    # Horovod's factors: integers scaled in float64 and truncated; an integer average
    # with a postscale is the sum scaled once by post / size
    rows = 2 * N + 1
    q, m = divmod(rows, N)
    lo = R * q + min(R, m)
    hi = lo + q + (R < m)
    xs = [tf.constant(rank_values(R, (rows, 2), d).astype(np_dtype(d)))
          for d in (tf.float64, tf.int32)]

    def scatter(f, i):
        return [matex.reducescatter(t, op=op, prescale_factor=0.5, postscale_factor=3.0)
                for t in (f, i) for op in ("sum", "average")]

    fs, fa, i_s, ia = run(mode, scatter, *xs)
    f_sum = sum(rank_values(r, (rows, 2), tf.float64) * 0.5 for r in range(N))[lo:hi]
    np.testing.assert_allclose(fs.numpy(), f_sum * 3.0, rtol=1e-12)
    np.testing.assert_allclose(fa.numpy(), f_sum / N * 3.0, rtol=1e-12)
    i_sum = sum(np.trunc(rank_values(r, (rows, 2), tf.int32) * 0.5) for r in range(N))[lo:hi]
    np.testing.assert_array_equal(i_s.numpy(), np.trunc(i_sum * 3.0))
    np.testing.assert_array_equal(ia.numpy(), np.trunc(i_sum * (3.0 / N)))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_and_reducescatter_on_a_slot(mode):
    """On a slot ordering the ranks backwards, rank R is slot rank N-1-R for both ops."""
    reverse = matex.comm().Split(0, N - R)
    slot = _runtime.register_comm(reverse)
    me = N - 1 - R
    try:
        x = tf.constant(np.arange(N, dtype=np.float32) + 10 * me)   # row j goes to slot rank j
        out, received = run(mode, lambda t: matex.alltoall(t, [1] * N, comm=slot), x)
        np.testing.assert_array_equal(out.numpy(), [10 * r + me for r in range(N)])
        assert received.numpy().tolist() == [1] * N
        got = run(mode, lambda t: matex.reducescatter(t, op="sum", comm=slot), x)
        np.testing.assert_array_equal(got.numpy(), [N * me + 10 * sum(range(N))])
    finally:
        _runtime.release_comm(slot)
        reverse.Free()


def test_reducescatter_fewer_rows_than_ranks():
    got = matex.reducescatter(tf.ones([1, 2]), op="sum")
    assert got.shape == ((1, 2) if R == 0 else (0, 2))
    np.testing.assert_array_equal(got.numpy(), np.full(got.shape, float(N)))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_gradient_returns_to_the_sender(mode):
    x = tf.Variable(a2a_input(R, tf.float32))

    def grad():
        with tf.GradientTape() as tape:
            out, _ = matex.alltoall(x, a2a_splits(R))
            y = tf.reduce_sum(out * (R + 1.0))
        return tape.gradient(y, x)

    # the rows rank R sent to rank j get j + 1 (j's loss weight)
    want = np.concatenate([np.full((s, 2), j + 1.0) for j, s in enumerate(a2a_splits(R))])
    np.testing.assert_array_equal(run(mode, grad).numpy(), want)


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_gradients(mode):
    rows = 2 * N + 1
    q, m = divmod(rows, N)
    owner = np.array([r for r in range(N) for _ in range(q + (r < m))])   # row -> its rank
    # distinct values: rank r's element (i, k) is (i + 1) * (1 + k) + 0.5 r, so the
    # last rank holds every max and rank 0 every min
    x = tf.Variable(np.fromfunction(lambda i, k: (i + 1) * (1 + k) + 0.5 * R, (rows, 2))
                    .astype(np.float64))

    def grads():
        out = []
        for op in ["sum", "average", "min", "max", "product"]:
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(matex.reducescatter(x, op=op) * (R + 1.0))
            out.append(tape.gradient(y, x))
        return out

    s, a, lo, hi, p = [g.numpy() for g in run(mode, grads)]
    weight = (owner + 1.0)[:, None] * np.ones((rows, 2))   # d loss / d output row
    np.testing.assert_array_equal(s, weight)
    np.testing.assert_allclose(a, weight / N)
    np.testing.assert_array_equal(lo, weight * (R == 0))
    np.testing.assert_array_equal(hi, weight * (R == N - 1))
    allx = np.stack([np.fromfunction(lambda i, k: (i + 1) * (1 + k) + 0.5 * r, (rows, 2))
                     for r in range(N)])
    others = np.prod(np.delete(allx, R, axis=0), axis=0)
    np.testing.assert_allclose(p, weight * others, rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_product_gradient_exact_with_zeros(mode):
    # element 0: zero on rank 0 only; element 1: zero on ranks 0 and 1; element 2: none
    vals = [0.0 if R == 0 else R + 1.0, 0.0 if R < 2 else 3.0, R + 2.0]
    x = tf.Variable(vals, dtype=tf.float64)

    def grad():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(matex.allreduce(x, "product") * (R + 1.0))
        return tape.gradient(y, x)

    allx = np.array([[0.0 if r == 0 else r + 1.0, 0.0 if r < 2 else 3.0, r + 2.0]
                     for r in range(N)])
    others = np.prod(np.delete(allx, R, axis=0), axis=0)
    total = sum(r + 1.0 for r in range(N))
    np.testing.assert_allclose(run(mode, grad).numpy(), total * others, rtol=1e-12)


def test_alltoall_and_reducescatter_mismatches_fail_on_every_rank():
    cases = [
        lambda: matex.alltoall(tf.ones([N], tf.float32 if R == 0 else tf.int32)),
        lambda: matex.alltoall(tf.ones([N, 2 + (R == N - 1)])),
        lambda: matex.reducescatter(tf.ones([N + (R == 0), 2]), op="sum"),
        lambda: matex.reducescatter(tf.ones([N]), op="sum" if R else "max"),
    ]
    for case in cases:
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            case()
        assert matex.errors.is_mismatch(info.value)
        for r in range(N):
            assert "rank %d:" % r in str(info.value)
    assert float(matex.allreduce(tf.constant(1.0), "sum")) == N


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_invalid_splits_on_one_rank_fail_everywhere_alike(mode):
    bad = N - 1
    # rank `bad` passes splits that sum to one row too many; the others are right
    splits = [1] * N
    if R == bad:
        splits[0] = 2
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        run(mode, lambda t: matex.alltoall(t, splits), tf.ones([N, 2]))
    assert ("invalid splits on rank %d: splits sum to %d, not to the first dimension %d"
            % (bad, N + 1, N)) in str(info.value)
    # an equal split that does not divide, on rank 0 only
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="rank 0: the first dimension %d does not split equally" % (N + 1)):
        matex.alltoall(tf.ones([N + (R == 0)]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank %d: 1 splits for %d ranks"
                       % (bad, N)):
        matex.alltoall(tf.ones([N]), [N] if R == bad else [1] * N)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scalar"):
        matex.reducescatter(tf.constant(1.0), op="sum")
    out, _ = matex.alltoall(tf.ones([N]))   # still in step
    assert out.shape == (N,)


def test_bool_sums_are_refused():
    for fn in (matex.allreduce, matex.reducescatter):
        with pytest.raises(TypeError, match="bool tensors supports op min"):
            fn(tf.ones([N], tf.bool), op="sum")


def test_flight_recorder_names_alltoall_reducescatter_and_new_dtypes():
    from matex.flight import _recorder

    core = _runtime._core()
    if core.flight_capacity() == 0:
        pytest.skip("flight recorder off")
    # min: a sum or product of 8/16-bit integers travels as int32 (test_small_integers_wrap...)
    matex.reducescatter(tf.ones([N, 2], tf.int8), op="min")
    matex.alltoall(tf.ones([N], tf.bool))
    ops = [_recorder._entry(e)["op"] for e in core.flight_entries()[-2:]]
    assert ops == ["reducescatter(min) of int8[%d,2]" % N, "alltoall of bool[%d]" % N]


def test_order_is_program_order_inside_tf_function():
    # 40 independent collectives of different shapes: if TF ran them in a
    # different order on some rank, the agreement check would fail the call.
    @tf.function
    def many(x):
        outs = []
        for i in range(40):
            t = tf.fill([i + 1], x)
            outs.append(matex.allreduce(t, "sum") if i % 3 else matex.broadcast(t, root=0))
        return outs

    for _ in range(5):
        outs = many(tf.constant(1.0))
    for i, o in enumerate(outs):
        assert o.shape == (i + 1,)
    graph = many.get_concrete_function(tf.constant(1.0)).graph
    coll = [op for op in graph.get_operations() if op.type.startswith("Matex")]
    assert len(coll) == 40
    for prev, op in zip(coll, coll[1:]):
        assert prev in op.control_inputs, "%s is not ordered after %s" % (op.name, prev.name)


def test_fusion_packs_200_small_tensors_into_one_allreduce():
    core = _runtime._core()
    grads = [tf.fill([256], float(R + i)) for i in range(200)]
    before = core.collective_call_count()
    fused = _fusion.allreduce_gradients(grads, "average", threshold=1 << 20)
    fused_calls = core.collective_call_count() - before
    before = core.collective_call_count()
    unfused = _fusion.allreduce_gradients(grads, "average", threshold=0)
    unfused_calls = core.collective_call_count() - before
    assert fused_calls == 2          # one agreement check + one data allreduce
    assert unfused_calls == 400
    for i, (f, u) in enumerate(zip(fused, unfused)):
        want = sum(r + i for r in range(N)) / N
        np.testing.assert_allclose(f.numpy(), want, rtol=1e-6)
        np.testing.assert_array_equal(f.numpy(), u.numpy())


def test_fusion_buckets_follow_backprop_order_and_threshold():
    ts = [tf.zeros([256]) for _ in range(5)] + [tf.zeros([10], tf.float64)]
    buckets = _fusion.plan_buckets(ts, threshold=2 * 1024)
    # reverse order; the float64 tensor alone; 1 KiB each -> two per bucket
    assert buckets == [[5], [4, 3], [2, 1], [0]]


def test_overlap_bucket_depends_only_on_its_gradients():
    # In a traced step, the first bucket's allreduce must not wait for the
    # gradients of earlier layers: that is what lets it overlap with backprop.
    layers = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(4)]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in layers:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h)
        grads = tape.gradient(loss, layers)
        return _fusion.allreduce_gradients(grads, "average", threshold=64 * 64 * 4)

    graph = step.get_concrete_function(tf.ones([8, 64])).graph
    ops = [op for op in graph.get_operations() if op.type == "MatexAllreduce"]
    assert len(ops) == 4

    def ancestors(op):
        seen, todo = set(), [op]
        while todo:
            o = todo.pop()
            for t in list(o.inputs) + list(o.control_inputs):
                src = t.op if hasattr(t, "op") else t
                if src not in seen:
                    seen.add(src)
                    todo.append(src)
        return seen

    first = ancestors(ops[0])   # gradient of the last layer
    last_grad_op = ops[-1].inputs[0].op   # gradient of the first layer
    assert last_grad_op not in first


@pytest.mark.skipif(N < 2, reason="needs two groups of ranks")
@pytest.mark.parametrize("mode", MODES + ["nested-function"])
def test_mpi_failure_is_a_tf_error_carrying_the_mpi_error_class(mode):
    from mpi4py import MPI

    # MPI_IN_PLACE is erroneous on an intercommunicator: MPI itself reports it.
    color = R % 2
    local = matex.comm().Split(color, R)
    inter = local.Create_intercomm(0, matex.comm(), 1 - color, tag=7)
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    core = _runtime._core()
    core.set_communicator(MPI._handleof(inter))
    try:
        with pytest.raises(tf.errors.InternalError) as info:
            if mode == "nested-function":   # as inside Keras's train step
                inner = tf.function(lambda t: matex.allreduce(t, "sum"))
                tf.function(lambda t: inner(t) * 2)(tf.ones([3]))
            else:
                run(mode, lambda t: matex.allreduce(t, "sum"), tf.ones([3]))
    finally:
        core.set_communicator(MPI._handleof(matex.comm()))
        inter.Free()
        local.Free()
    cls = matex.mpi_error_class(info.value)
    assert cls is not None and cls > 0 and cls != MPI.SUCCESS
    assert "MPI error class %d" % cls in str(info.value)
    assert matex.mpi_error_class(tf.errors.InternalError(None, None, "other")) is None
    assert float(matex.allreduce(tf.constant(2.0), "sum")) == 2 * N


def test_size_and_rank_ops_follow_the_communicator():
    rank, size = _collectives.comm_info()
    assert (int(rank), int(size)) == (R, N)
    assert matex.local_size() >= 1 and 0 <= matex.local_rank() < matex.local_size()
    assert _native.core() is _runtime._core()


# ---- communicator slots -------------------------------------------------------

def test_slot_collectives_run_on_their_sub_communicator_beside_the_data_one():
    """An op naming a slot reduces over that sub-communicator only, in one traced
    function together with a slot-0 allreduce; replacing the slot needs no retrace."""
    world = matex.comm()
    sub = world.Split(R % 2, R)
    slot = _runtime.register_comm(sub)
    try:
        members = [r for r in range(N) if r % 2 == R % 2]

        @tf.function
        def both(x):
            return (_collectives.allreduce(x, "sum", comm=slot),
                    _collectives.allreduce(x, "sum"),
                    _collectives.allgather(tf.reshape(x, [1]), comm=slot),
                    _collectives.comm_info(comm=slot))

        x = tf.constant(float(R + 1))
        part, whole, gathered, (srank, ssize) = both(x)
        assert float(part) == sum(r + 1 for r in members)
        assert float(whole) == N * (N + 1) / 2
        np.testing.assert_array_equal(gathered.numpy(), [r + 1.0 for r in members])
        assert (int(srank), int(ssize)) == (sub.Get_rank(), sub.Get_size())
        np.testing.assert_array_equal(
            _collectives.broadcast(tf.constant([float(R)]), root=0, comm=slot).numpy(),
            [float(members[0])])
        # gradients run on the op's own communicator
        v = tf.Variable(float(R + 1))
        with tf.GradientTape() as tape:
            y = _collectives.allreduce(v * v, "sum", comm=slot)
        assert float(tape.gradient(y, v)) == 2 * (R + 1) * len(members)
        # the slot now names the whole world: the traced function follows, untraced again
        _runtime.replace_comm(slot, world)
        part, _, _, (_, ssize) = both(x)
        assert float(part) == N * (N + 1) / 2 and int(ssize) == N
        assert both.experimental_get_tracing_count() == 1
    finally:
        _runtime.release_comm(slot)
        sub.Free()
    with pytest.raises(tf.errors.InternalError, match="no communicator in slot %d" % slot):
        _collectives.allreduce(tf.constant(1.0), comm=slot)


# ---- Horovod's API (#25): scale factors, barrier, grouped ops, objects ---------

PRE, POST = 0.3, 1.7


def scaled(values, factor, dtype):
    """``values * factor`` as the scale factors promise: integers in float64 then
    truncated toward zero; float16/bfloat16 rounded to float32 then to the dtype."""
    if dtype.is_integer:
        return np.trunc(values * factor)
    if dtype in (tf.float16, tf.bfloat16):
        out = (values.astype(np.float32) * np.float32(factor)).astype(np_dtype(dtype))
        return out.astype(np.float64)
    return values * factor


def expected_scaled_reduce(op, shape, dtype, r_values=rank_values):
    parts = [scaled(r_values(r, shape, dtype), PRE, dtype) for r in range(N)]
    total = np.sum(parts, 0)
    if op == "sum":
        return scaled(total, POST, dtype)
    if dtype.is_integer:   # Horovod: the sum scaled once by post / size, truncated once
        return np.trunc(total * (POST / N))
    return scaled(total / N, POST, dtype)


def scale_tolerance(dtype):
    return {tf.float16: 4e-3, tf.bfloat16: 3e-2, tf.float32: 1e-6}.get(dtype, 1e-12)


def assert_scaled(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    if dtype.is_integer:
        np.testing.assert_array_equal(got.numpy(), want, err_msg=dtype.name)
    else:
        np.testing.assert_allclose(got.numpy().astype(np.float64), want, err_msg=dtype.name,
                                   rtol=scale_tolerance(dtype), atol=scale_tolerance(dtype))


SCALED = DTYPES + [tf.uint8, tf.int8, tf.uint16, tf.int16]


def scale_values(r, shape, dtype):
    values = rank_values(r, shape, dtype)
    return np.abs(values) if dtype.is_unsigned else values


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_allreduce_prescale_and_postscale(op, mode):
    """Every dtype (one traced function for all)."""
    shape = (3, 5)
    xs = [tf.constant(scale_values(R, shape, d).astype(np_dtype(d))) for d in SCALED]
    got = run(mode, lambda *ts: [matex.allreduce(t, op=op, prescale_factor=PRE,
                                                 postscale_factor=POST) for t in ts], *xs)
    for g, dtype in zip(got, SCALED):
        assert_scaled(g, expected_scaled_reduce(op, shape, dtype, scale_values), dtype)
    with pytest.raises(TypeError, match="bool"):
        matex.allreduce(tf.constant([True]), op="max", prescale_factor=PRE)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_prescale_and_postscale(mode):
    """One group per dtype (a group has one dtype), all in one traced function."""
    shapes = [(4,), (2, 3)]
    xs = [tf.constant(rank_values(R + 7 * i, s, d).astype(np_dtype(d)))
          for d in DTYPES for i, s in enumerate(shapes)]

    def groups(*ts):
        return [matex.grouped_allreduce(list(ts[2 * k:2 * k + 2]), op="average",
                                        prescale_factor=PRE, postscale_factor=POST)
                for k in range(len(DTYPES))]

    for dtype, got in zip(DTYPES, run(mode, groups, *xs)):
        for i, (g, s) in enumerate(zip(got, shapes)):
            want = expected_scaled_reduce(
                "average", s, dtype, lambda r, shape, d, i=i: rank_values(r + 7 * i, shape, d))
            assert_scaled(g, want, dtype)


def test_scale_factors_carry_into_the_gradient():
    x = tf.Variable(np.arange(4, dtype=np.float32) + R)
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(matex.allreduce(x, "sum", prescale_factor=0.5, postscale_factor=3.0)
                          * (R + 1.0))
    total = sum(r + 1.0 for r in range(N))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), np.full(4, 1.5 * total))


@pytest.mark.parametrize("mode", MODES)
def test_barrier_waits_for_the_last_rank(mode):
    """No rank leaves the barrier before the slowest (rank 0, 0.6 s late) enters it,
    also inside tf.function when its result is unused."""
    @tf.function
    def in_function():
        matex.barrier()
        return tf.constant(0)

    assert int(matex.barrier()) == N
    if mode == "function":
        in_function()   # traced and run once before timing
    matex.barrier()
    started = time.monotonic()
    if R == 0:
        time.sleep(0.6)
    if mode == "function":
        in_function()
    else:
        assert int(matex.barrier()) == N
    waited = time.monotonic() - started
    assert waited >= 0.5, waited
    if mode == "function":
        kinds = [op.type for op in in_function.get_concrete_function().graph.get_operations()]
        assert kinds.count("MatexAllreduce") == 1


def gather_values(r, i, dtype):
    """Rank r's tensor i of the grouped allgather: r + i + 1 rows, uneven over ranks."""
    trailing = [(), (3,), (2, 2)][i % 3]
    return rank_values(100 * i + r, (r + i + 1,) + trailing, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather(mode):
    """Every dtype, interleaved in one group (one message per dtype)."""
    dtypes = DTYPES + DTYPES[::-1]
    xs = [tf.constant(gather_values(R, i, d).astype(np_dtype(d))) for i, d in enumerate(dtypes)]
    got = run(mode, lambda *ts: matex.grouped_allgather(list(ts)), *xs)
    assert len(got) == len(xs)
    for i, (g, d) in enumerate(zip(got, dtypes)):
        want = np.concatenate([gather_values(r, i, d) for r in range(N)])
        assert g.dtype == d and g.shape == want.shape
        np.testing.assert_array_equal(g.numpy().astype(np.float64), want)


def test_grouped_ops_are_one_message_per_dtype():
    f = tf.function(lambda a, b, c: matex.grouped_allgather([a, b, c]))
    graph = f.get_concrete_function(tf.TensorSpec([None, 2], tf.float32),
                                    tf.TensorSpec([None], tf.float32),
                                    tf.TensorSpec([None], tf.int64)).graph
    kinds = [op.type for op in graph.get_operations()]
    assert kinds.count("MatexAllgather") == 3   # the shapes, the float32s, the int64s
    assert matex.grouped_allgather([]) == []
    f = tf.function(lambda a, b, c: matex.grouped_reducescatter([a, b, c]))
    graph = f.get_concrete_function(tf.TensorSpec([None, 2], tf.float32),
                                    tf.TensorSpec([None], tf.float32),
                                    tf.TensorSpec([None], tf.int64)).graph
    kinds = [op.type for op in graph.get_operations()]
    assert kinds.count("MatexReducescatter") == 2 and "MatexAllreduce" not in kinds


@pytest.mark.parametrize("what", ["count", "dtype", "trailing"])
def test_grouped_allgather_disagreement_fails_on_every_rank(what):
    a = tf.ones([R + 1, 2])
    if what == "count":
        group = [a] * (1 + (R == N - 1))
    elif what == "dtype":
        group = [a, tf.ones([2], tf.float32 if R == 0 else tf.float64)]
    else:
        group = [tf.ones([2, 2 + (R == 0)])]
    with pytest.raises(tf.errors.InvalidArgumentError, match="grouped_allgather"):
        matex.grouped_allgather(group)
    # no rank was left inside a collective: the next one matches on every rank
    assert float(matex.allreduce(tf.constant(1.0), "sum")) == N


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather_gradient(mode):
    """Each rank's rows of the output gradient, summed over ranks (as allgather's)."""
    xs = [tf.Variable(gather_values(R, i, tf.float32).astype(np.float32)) for i in range(2)]

    def weights(r, i):
        total = sum(r2 + i + 1 for r2 in range(N))
        shape = (total,) + xs[i].shape[1:]
        return np.random.default_rng(50 * r + i).normal(size=shape).astype(np.float32)

    def grads():
        with tf.GradientTape() as tape:
            out = matex.grouped_allgather(xs)
            y = sum(tf.reduce_sum(o * weights(R, i)) for i, o in enumerate(out))
        return tape.gradient(y, xs)

    got = run(mode, grads)
    for i, g in enumerate(got):
        start = sum(r + i + 1 for r in range(R))
        rows = slice(start, start + R + i + 1)
        want = sum(weights(r, i)[rows] for r in range(N))
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want, rtol=1e-5, atol=1e-6)


def own_rows(total, r, n):
    q, m = divmod(total, n)
    start = r * q + min(r, m)
    return slice(start, start + q + (r < m))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_grouped_reducescatter(op, mode):
    """Every dtype in one group; rows not divisible by the size: the first ranks
    get one more (Horovod's split)."""
    shapes = [(5, 2), (N + 1,), (2 * N, 1, 2)]
    cases = [(d, i, s) for i, s in enumerate(shapes) for d in DTYPES]
    xs = [tf.constant(rank_values(R + 9 * i, s, d).astype(np_dtype(d))) for d, i, s in cases]
    got = run(mode, lambda *ts: matex.grouped_reducescatter(list(ts), op=op), *xs)
    for g, (dtype, i, s) in zip(got, cases):
        stack = np.stack([rank_values(r + 9 * i, s, dtype) for r in range(N)])
        full = {"sum": stack.sum(0), "max": stack.max(0),
                "average": np.trunc(stack.sum(0) / N) if dtype.is_integer else stack.sum(0) / N}[op]
        want = full[own_rows(s[0], R, N)]
        assert g.dtype == dtype and g.shape == want.shape
        np.testing.assert_allclose(g.numpy().astype(np.float64), want, rtol=tolerance(dtype))


def test_grouped_reducescatter_scale_factors_and_gradient():
    x = tf.Variable(np.arange(10, dtype=np.float32).reshape(5, 2) + R)
    weight = np.float32(R + 1)
    with tf.GradientTape() as tape:
        (out,) = matex.grouped_reducescatter([x], op="average", prescale_factor=2.0,
                                             postscale_factor=0.5)
        y = tf.reduce_sum(out * weight)
    stack = np.stack([np.arange(10, dtype=np.float64).reshape(5, 2) + r for r in range(N)])
    np.testing.assert_allclose(out.numpy(), (stack.mean(0))[own_rows(5, R, N)], rtol=1e-6)
    # d y_r / d x: rank r's rows weighted (r + 1), averaged over ranks, scaled by 2 * 0.5
    want = np.zeros((5, 2))
    for r in range(N):
        want[own_rows(5, r, N)] = (r + 1.0) / N
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), want, rtol=1e-6)


# ---- objects --------------------------------------------------------------------

class _FailsToLoadOnLastRank:
    def __reduce__(self):
        return (_load_unless_last_rank, ())


def _load_unless_last_rank():
    if matex.rank() == matex.size() - 1:
        raise RuntimeError("cannot load here")
    return "loaded"


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_object_and_fn(root):
    root_rank = 0 if root == "first" else N - 1
    mine = {"rank": R, "array": np.arange(R + 3), "nested": [("x", R)] * 2}
    got = matex.broadcast_object(mine, root_rank=root_rank)
    assert got["rank"] == root_rank and got["nested"] == [("x", root_rank)] * 2
    np.testing.assert_array_equal(got["array"], np.arange(root_rank + 3))
    assert (got is mine) == (R == root_rank)   # the root keeps its own object
    bcast = matex.broadcast_object_fn(root_rank=root_rank)
    assert bcast(("value of", R)) == ("value of", root_rank)
    assert bcast(R * 10) == root_rank * 10


def test_allgather_object():
    got = matex.allgather_object({"rank": R, "rows": list(range(R))})
    assert got == [{"rank": r, "rows": list(range(r))} for r in range(N)]
    assert matex.allgather_object(None) == [None] * N


def test_object_collectives_on_a_slot():
    """On a slot whose communicator orders the ranks backwards, its rank 0 is the last rank."""
    reverse = matex.comm().Split(0, N - R)
    slot = _runtime.register_comm(reverse)
    try:
        assert matex.broadcast_object(R, root_rank=0, comm=slot) == N - 1
        assert matex.allgather_object(R, comm=slot) == list(reversed(range(N)))
        assert int(matex.barrier(comm=slot)) == N
    finally:
        _runtime.release_comm(slot)
        reverse.Free()


def test_object_errors_are_one_error_on_every_rank():
    from matex._everywhere import RemoteError

    root_rank = N - 1
    unpicklable = (lambda: 0) if R == root_rank else None
    with pytest.raises(RemoteError, match="rank %d: .*pickl" % root_rank):
        matex.broadcast_object(unpicklable, root_rank=root_rank)
    with pytest.raises(RemoteError, match="rank %d: RuntimeError: cannot load here" % (N - 1)):
        matex.broadcast_object(_FailsToLoadOnLastRank(), root_rank=0)
    with pytest.raises(RemoteError, match="rank 0: .*pickl"):
        matex.allgather_object((lambda: 0) if R == 0 else R)
    with pytest.raises(RemoteError, match="root_rank %d is not a rank" % N):
        matex.broadcast_object(1, root_rank=N)
    # everyone still in step
    assert matex.allgather_object(R) == list(range(N))


def test_tf1_session_runs_independent_collectives_in_one_order():
    """A TF1 graph's independent collectives ran in any order in a Session, a different
    one per rank: 8 allreduces on 2 ranks returned wrong sums with no error (20 of 20
    runs). The run's collectives now take their turn in one order agreed by every rank
    (matex.legacy._schedule); gradients built by tf.gradients and an allgather among them
    are ordered too."""
    for trial in range(3):
        g = tf.Graph()
        with g.as_default():
            xs = [tf.fill([4], float(i * 10 + R)) for i in range(8)]
            outs = [matex.allreduce(x, op="sum") for x in xs]
            gathered = matex.allgather(tf.fill([R + 1, 2], float(R)))
            loss = tf.add_n([tf.reduce_sum(o * (i + 1)) for i, o in enumerate(outs)])
            grads = tf.compat.v1.gradients(loss, xs)
            with tf.compat.v1.Session(graph=g) as s:
                got, got_gathered, got_grads = s.run([outs, gathered, grads])
        for i, v in enumerate(got):
            np.testing.assert_array_equal(v, np.full(4, sum(i * 10 + r for r in range(N))))
        np.testing.assert_array_equal(
            got_gathered, np.concatenate([np.full([r + 1, 2], float(r)) for r in range(N)]))
        for i, gr in enumerate(got_grads):   # d/dx_i of sum_r (i+1) * sum(allreduce): (i+1) * N
            np.testing.assert_array_equal(gr, np.full(4, (i + 1) * N))
