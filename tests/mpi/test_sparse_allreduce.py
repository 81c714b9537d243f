"""matex.sparse_allreduce against the dense allreduce of the densified inputs (any rank count).

Every case draws each rank's (indices, rows) from a generator seeded by the
case and the rank, so every rank can rebuild every other rank's input and
compute the exact reference sum itself; the result must match it and be
bitwise equal on every rank.
"""

import numpy as np
import pytest
import tensorflow as tf

import matex
from helpers import all_equal_bytes

RANK, SIZE = matex.rank(), matex.size()


def inputs(seed, rank, rows, density, row_shape=(), dtype=np.float32, duplicates=False):
    rng = np.random.default_rng([seed, rank])
    n = int(round(density * rows))
    if duplicates:
        idx = rng.integers(0, rows, size=n)
    else:
        idx = rng.permutation(rows)[:n]
    vals = rng.standard_normal((n,) + tuple(row_shape)).astype(dtype)
    return idx.astype(np.int64), vals


def reference(seed, rows, density, row_shape=(), dtype=np.float32, duplicates=False,
              empty_ranks=()):
    total = np.zeros((rows,) + tuple(row_shape), np.float64)
    for r in range(SIZE):
        if r in empty_ranks:
            continue
        idx, vals = inputs(seed, r, rows, density, row_shape, dtype, duplicates)
        np.add.at(total, idx, vals.astype(np.float64))
    return total


def check(result, ref, tol):
    dense = tf.convert_to_tensor(result).numpy()
    assert dense.shape == ref.shape
    np.testing.assert_allclose(dense.astype(np.float64), ref, rtol=tol, atol=tol)
    assert all_equal_bytes([dense]), "ranks got different bits"
    if isinstance(result, tf.IndexedSlices):
        idx = result.indices.numpy()
        assert np.all(np.diff(idx) > 0), "indices not sorted and unique"
    return dense


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.2, 0.5])
@pytest.mark.parametrize("row_shape", [(), (3,)])
def test_random_densities(density, row_shape):
    seed = int(density * 1000) + 7 * len(row_shape)
    idx, vals = inputs(seed, RANK, 2000, density, row_shape)
    result = matex.sparse_allreduce(idx, vals, (2000,) + row_shape)
    check(result, reference(seed, 2000, density, row_shape), 1e-5)


@pytest.mark.parametrize("threshold", [0.001, 0.3, 2.0])
def test_switch_point_does_not_change_the_sum(threshold):
    idx, vals = inputs(11, RANK, 500, 0.1, (2,), duplicates=True)
    result = matex.sparse_allreduce(idx, vals, [500, 2], density_threshold=threshold)
    check(result, reference(11, 500, 0.1, (2,), duplicates=True), 1e-5)
    # the format follows the switch point: 0.001 goes dense at once, 2.0 never
    if threshold == 0.001:
        assert not isinstance(result, tf.IndexedSlices)
    if threshold == 2.0:
        assert isinstance(result, tf.IndexedSlices)


def test_duplicate_indices_are_summed():
    idx = np.array([5, 5, 5, 1, 5], np.int32)          # int32 ids, repeated
    vals = np.ones((5, 2), np.float64) * (RANK + 1)
    result = matex.sparse_allreduce(idx, vals, [8, 2], density_threshold=2.0)
    ranks = SIZE * (SIZE + 1) / 2
    expected = np.zeros((8, 2))
    expected[5] = 4 * ranks
    expected[1] = ranks
    check(result, expected, 0)
    assert result.indices.numpy().tolist() == [1, 5]


def test_empty_inputs_on_some_ranks():
    empty = {r for r in range(SIZE) if r % 2 == 1}
    idx, vals = inputs(3, RANK, 300, 0.05, (4,))
    if RANK in empty:
        idx, vals = idx[:0], vals[:0]
    result = matex.sparse_allreduce(idx, vals, [300, 4])
    check(result, reference(3, 300, 0.05, (4,), empty_ranks=empty), 1e-5)


def test_empty_everywhere():
    result = matex.sparse_allreduce(np.zeros([0], np.int64), np.zeros([0, 3], np.float32),
                                    [10, 3])
    assert isinstance(result, tf.IndexedSlices) and result.indices.shape[0] == 0
    check(result, np.zeros((10, 3)), 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int64, np.int32])
def test_dtypes(dtype):
    rng = np.random.default_rng([5, RANK])
    idx = rng.permutation(100)[:20]
    vals = rng.integers(-4, 5, size=(20, 2)).astype(dtype)   # exact in every dtype
    result = matex.sparse_allreduce(idx, vals, [100, 2])
    expected = np.zeros((100, 2))
    for r in range(SIZE):
        g = np.random.default_rng([5, r])
        i = g.permutation(100)[:20]
        np.add.at(expected, i, g.integers(-4, 5, size=(20, 2)))
    dense = check(result, expected, 0)
    assert dense.dtype == dtype


def test_average():
    idx, vals = inputs(9, RANK, 400, 0.05)
    result = matex.sparse_allreduce(idx, vals, [400], op="average")
    check(result, reference(9, 400, 0.05) / SIZE, 1e-6)


def test_inside_tf_function():
    idx, vals = inputs(21, RANK, 1000, 0.01, (2,))

    @tf.function
    def run(i, v):
        result = matex.sparse_allreduce(i, v, [1000, 2])
        assert isinstance(result, tf.IndexedSlices)
        return tf.convert_to_tensor(result)

    for _ in range(2):
        check(run(idx, vals), reference(21, 1000, 0.01, (2,)), 1e-5)


def test_gradient():
    # d sum(w * out) / d values_r = w at each rank's indices, summed over ranks
    idx, vals = inputs(31, RANK, 50, 0.2, (2,))
    weights = tf.constant(np.arange(100, dtype=np.float32).reshape(50, 2))
    values = tf.constant(vals)
    with tf.GradientTape() as tape:
        tape.watch(values)
        out = tf.convert_to_tensor(matex.sparse_allreduce(idx, values, [50, 2]))
        loss = tf.reduce_sum(out * weights)
    grad = tape.gradient(loss, values).numpy()
    np.testing.assert_allclose(grad, SIZE * weights.numpy()[idx])


def test_index_out_of_range_fails_on_every_rank():
    idx = np.array([1, 2, 10 if RANK == SIZE - 1 else 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range|outside"):
        matex.sparse_allreduce(idx, np.ones([3], np.float32), [10])
    # and the communicator is still usable afterwards
    check(matex.sparse_allreduce([0], np.ones([1], np.float32), [4]),
          np.array([SIZE, 0, 0, 0], np.float64), 0)


def test_ranks_disagreeing_on_the_row_shape_fail_on_every_rank():
    cols = 3 if RANK == 0 else 4
    with pytest.raises(tf.errors.InvalidArgumentError, match="disagree"):
        matex.sparse_allreduce([0], np.ones([1, cols], np.float32), [5, cols])


def test_bad_arguments():
    with pytest.raises(ValueError, match="density_threshold"):
        matex.sparse_allreduce([0], [1.0], [2], density_threshold=0)
    with pytest.raises(TypeError, match="int32 or int64"):
        matex.sparse_allreduce([0.5], [1.0], [2])
    with pytest.raises(ValueError, match="op"):
        matex.sparse_allreduce([0], [1.0], [2], op="max")


def test_flight_recorder_and_timeline_bytes_are_the_bytes_sent():
    # the flight entry (and the timeline, which reads it) recorded the dense
    # tensor's bytes (500 x 8 x 4 = 16000 here), not the stream this rank sent
    from matex import _native, _sparse

    idx, vals = inputs(12, RANK, 500, 0.02, (8,))
    *_, sent = _sparse.exchange(idx, vals, 500, density_threshold=2.0)
    entry = _native.core().flight_entries()[-1]
    assert entry["kind"] == 8                        # sparse allreduce
    assert entry["bytes"] == int(sent) > 0
    assert int(sent) < 500 * 8 * 4 or SIZE == 1
