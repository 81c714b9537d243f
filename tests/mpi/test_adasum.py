"""op="adasum" against a NumPy reference of the same order of combination, on any rank count
(run on 2 and 3 ranks with the collectives suite, on 4 with the 4-rank pipeline suite)."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import matex
from matex import _adasum, _collectives

R, N = matex.rank(), matex.size()
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
MODES = ["eager", "function"]
SHAPES = [(3, 5), (7,), (), (2, 2)]   # odd lengths, one element (empty halves on 4 ranks)


def np_dtype(dtype):
    return ml_dtypes.bfloat16 if dtype == tf.bfloat16 else dtype.as_numpy_dtype


def rank_tensors(r, shapes):
    rng = np.random.default_rng(7000 + r)
    return [rng.uniform(-1.0, 1.0, size=s) for s in shapes]


def combine(a_list, b_list, dtype):
    """Adasum of two ranks' tensor lists, tensor by tensor, in float64, rounded to dtype."""
    out = []
    for a, b in zip(a_list, b_list):
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        dot, an, bn = a64 @ b64, a64 @ a64, b64 @ b64
        ca = 1.0 - dot / (2 * an) if an != 0 else 1.0
        cb = 1.0 - dot / (2 * bn) if bn != 0 else 1.0
        out.append((ca * a64 + cb * b64).reshape(a.shape).astype(np_dtype(dtype)))
    return out


def reference(per_rank, dtype):
    """Fold ranks 2i+1 into 2i until a power of two remains, then a binary tree in rank order."""
    items = [[t.astype(np_dtype(dtype)) for t in ts] for ts in per_rank]
    power = 1
    while power * 2 <= len(items):
        power *= 2
    extra = len(items) - power
    items = [combine(items[2 * i], items[2 * i + 1], dtype) for i in range(extra)] + \
        items[2 * extra:]
    while len(items) > 1:
        items = [combine(items[2 * j], items[2 * j + 1], dtype) for j in range(len(items) // 2)]
    return items[0]


def tolerance(dtype):
    return {tf.float16: 4e-3, tf.bfloat16: 3e-2, tf.float32: 1e-6}.get(dtype, 1e-12)


def run(mode, fn, *args):
    return tf.function(fn)(*args) if mode == "function" else fn(*args)


def same_on_every_rank(t):
    gathered = matex.allgather(tf.reshape(tf.cast(t, tf.float64), [1, -1])).numpy()
    assert (gathered == gathered[0]).all(), gathered


def test_reference_is_the_pairwise_formula_and_the_documented_order():
    a, b, c = (np.array([1.0, 0.0]),), (np.array([0.0, 2.0]),), (np.array([2.0, 0.0]),)
    # orthogonal: a sum; parallel: (1 - 2/2) a + (1 - 2/8) c = 1.5 a, between average and sum
    assert np.array_equal(combine(a, b, tf.float64)[0], [1.0, 2.0])
    assert np.array_equal(combine(a, c, tf.float64)[0], [1.5, 0.0])
    # 3 ranks: Adasum(Adasum(g0, g1), g2)
    assert np.array_equal(reference([a, b, c], tf.float64)[0],
                          combine(combine(a, b, tf.float64), c, tf.float64)[0])
    assert _adasum.layout(0, 3) == (2, 1, 0) and _adasum.layout(1, 3) == (2, 1, None)
    assert _adasum.layout(2, 3) == (2, 1, 1) and _adasum.layout(3, 4) == (4, 0, 3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_adasum_matches_numpy_reference(dtype, mode):
    per_rank = [rank_tensors(r, SHAPES) for r in range(N)]
    want = reference(per_rank, dtype)
    for shape, x, expected in zip(SHAPES, per_rank[R], want):
        got = run(mode, lambda t: matex.allreduce(t, op="adasum"),
                  tf.constant(x.astype(np_dtype(dtype))))
        assert got.dtype == dtype and got.shape == shape
        np.testing.assert_allclose(np.asarray(got, np.float64), expected.astype(np.float64),
                                   rtol=tolerance(dtype), atol=tolerance(dtype))
        same_on_every_rank(got)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
def test_grouped_adasum_combines_each_tensor_as_its_own_layer(dtype, mode):
    per_rank = [rank_tensors(r, SHAPES) for r in range(N)]
    want = reference(per_rank, dtype)
    mine = [tf.constant(x.astype(np_dtype(dtype))) for x in per_rank[R]]
    got = run(mode, lambda *ts: _collectives.grouped_allreduce(list(ts), op="adasum"), *mine)
    for g, expected in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), expected, rtol=tolerance(dtype),
                                   atol=tolerance(dtype))
        same_on_every_rank(g)
    # one fused vector would be another result: the per-layer coefficients matter
    whole = reference([[np.concatenate([t.ravel() for t in ts])] for ts in per_rank], dtype)[0]
    assert not np.allclose(np.concatenate([np.asarray(g).ravel() for g in got]), whole)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_adasum_of_many_small_tensors(mode):
    """More tensors in a part than _adasum.PIECES: the segment-sum path."""
    shapes = [(1 + i % 5,) for i in range(4 * _adasum.PIECES)]
    per_rank = [rank_tensors(r, shapes) for r in range(N)]
    got = run(mode, lambda *ts: _collectives.grouped_allreduce(list(ts), op="adasum"),
              *[tf.constant(x) for x in per_rank[R]])
    for g, expected in zip(got, reference(per_rank, tf.float64)):
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-12, atol=1e-12)


def test_grouped_adasum_of_mixed_dtypes():
    per_rank = [rank_tensors(r, [(4,), (3,)]) for r in range(N)]
    got = _collectives.grouped_allreduce([tf.constant(per_rank[R][0], tf.float64),
                                   tf.constant(per_rank[R][1].astype(np.float32))], op="adasum")
    assert [g.dtype for g in got] == [tf.float64, tf.float32]
    np.testing.assert_allclose(got[0].numpy(), reference(per_rank, tf.float64)[0], rtol=1e-12)
    np.testing.assert_allclose(got[1].numpy(), reference(per_rank, tf.float32)[1], rtol=1e-6)


def test_adasum_of_equal_gradients_is_the_gradient_and_of_orthogonal_ones_the_sum():
    g = tf.constant([0.5, -1.0, 2.0, 0.25], tf.float64)
    np.testing.assert_allclose(matex.allreduce(g, op="adasum").numpy(), g.numpy(), rtol=1e-15)
    basis = np.eye(N)[R] * (R + 1)                  # rank r: (r + 1) e_r
    np.testing.assert_allclose(matex.allreduce(tf.constant(basis), op="adasum").numpy(),
                               np.arange(1, N + 1, dtype=np.float64), rtol=1e-15)
    zero = tf.zeros([3], tf.float32)                # zero norms: coefficient 1, no NaN
    assert np.array_equal(matex.allreduce(zero, op="adasum").numpy(), np.zeros(3))


@pytest.mark.parametrize("dtype", [tf.float16, tf.float64], ids=lambda d: d.name)
def test_adasum_scale_factors(dtype):
    """Horovod's prescale/postscale factors; Adasum(c a, c b) = c Adasum(a, b)."""
    per_rank = [rank_tensors(r, [(5,)]) for r in range(N)]
    x = tf.constant(per_rank[R][0].astype(np_dtype(dtype)))
    got = _adasum.adasum(x, prescale_factor=2.0, postscale_factor=0.25)
    want = 0.5 * reference(per_rank, dtype)[0].astype(np.float64)
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=2 * tolerance(dtype))


def test_adasum_refuses_integers_and_undefined_shapes():
    with pytest.raises(TypeError, match="op='adasum' needs a floating-point tensor"):
        matex.allreduce(tf.constant([1, 2]), op="adasum")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def dynamic(t):
        return matex.allreduce(t, op="adasum")

    with pytest.raises(ValueError, match="needs a fully defined shape"):
        dynamic(tf.zeros([2]))


@pytest.mark.parametrize("mode", MODES)
def test_shape_mismatch_fails_on_every_rank(mode):
    x = tf.zeros([4 if R == N - 1 else 5], tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="ranks disagree on the dtype or the sizes of the tensors"):
        run(mode, lambda t: matex.allreduce(t, op="adasum"), x)
    # the channel is clean afterwards
    np.testing.assert_allclose(matex.allreduce(tf.ones([2]), op="adasum").numpy(), [1.0, 1.0])


@pytest.mark.parametrize("mode", MODES)
def test_distributed_optimizer_applies_the_adasum_of_the_gradients(mode):
    import keras

    shapes = [(3, 2), (2,)]
    per_rank = [rank_tensors(r, shapes) for r in range(N)]
    variables = [keras.Variable(np.ones(s, np.float32)) for s in shapes]
    opt = matex.DistributedOptimizer(keras.optimizers.SGD(0.5), op="adasum")
    grads = [tf.constant(g.astype(np.float32)) for g in per_rank[R]]
    run(mode, lambda *gs: opt.apply(list(gs), variables), *grads)
    for v, g in zip(variables, reference(per_rank, tf.float32)):
        np.testing.assert_allclose(v.numpy(), 1.0 - 0.5 * g, rtol=1e-6, atol=1e-6)
        same_on_every_rank(tf.convert_to_tensor(v))
    with pytest.raises(ValueError, match="op='adasum'"):
        matex.DistributedOptimizer(keras.optimizers.SGD(0.5), op="adasum", delay=1)


@pytest.mark.parametrize("mode", MODES)
def test_distributed_gradient_tape_adasum_densifies_sparse_gradients(mode):
    c = [rank_tensors(r, [(3,)])[0] for r in range(N)]
    rows = [np.zeros((4, 2)) for _ in range(N)]
    for r in range(N):
        rows[r][r % 4] = [r + 1.0, -1.0]            # rank r's embedding row gradient
    w = tf.Variable(tf.ones([3], tf.float64))
    emb = tf.Variable(tf.ones([4, 2], tf.float64))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c[R]) + tf.reduce_sum(
                tf.gather(emb, [R % 4]) * tf.constant(rows[R][R % 4], tf.float64))
        return matex.DistributedGradientTape(tape, op="adasum").gradient(loss, [w, emb])

    got = tf.function(step)() if mode == "function" else step()
    want = reference([[c[r], rows[r]] for r in range(N)], tf.float64)
    assert not isinstance(got[1], tf.IndexedSlices)
    for g, expected in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="op='adasum' sends its gradients uncompressed"):
        matex.DistributedGradientTape(tf.GradientTape(), op="adasum", compression="fp16")
