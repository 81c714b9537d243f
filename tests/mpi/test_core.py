"""The C++ core through pybind11, on NumPy arrays, without TensorFlow."""

import sys

import ml_dtypes
import numpy as np
import pytest

import matex
from matex import _runtime

R, N = matex.rank(), matex.size()
core = _runtime._core()


def values(r, shape=(5,), dtype=np.float32):
    return (np.arange(np.prod(shape)).reshape(shape) * (r + 1) - 3).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                   np.int32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "min", "max", "average"])
def test_allreduce(dtype, op):
    x = values(R, (2, 3), dtype)
    got = core.allreduce(x, np.dtype(dtype).name, op)
    stack = np.stack([values(r, (2, 3), np.float64) for r in range(N)])
    want = {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0),
            "average": stack.sum(0) / N}[op]
    if op == "average" and np.dtype(dtype).kind == "i":
        want = np.trunc(want)
    rtol = 1e-2 if np.dtype(dtype).itemsize == 2 else 1e-6
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol)


def test_fused_allreduce_is_one_data_call():
    arrays = [values(R + i, (i + 1,)) for i in range(50)]
    before = core.collective_call_count()
    out = core.fused_allreduce(arrays, "float32", "sum")
    assert core.collective_call_count() - before == 2   # agreement + data
    for i, o in enumerate(out):
        np.testing.assert_allclose(o, sum(values(r + i, (i + 1,)) for r in range(N)))


def test_broadcast_and_allgather():
    got = core.broadcast(values(R, (4,)), "float32", N - 1)
    np.testing.assert_array_equal(got, values(N - 1, (4,)))
    rows = np.full((R + 1, 2), R, np.int64)
    got = core.allgather(rows, "int64")
    np.testing.assert_array_equal(got, np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))


def test_mismatch_is_an_error_everywhere():
    with pytest.raises(core.MismatchError, match="rank 0: allreduce"):
        core.allreduce(np.ones(R + 1, np.float32), "float32", "sum")


def test_agreement_check_can_be_turned_off_and_back_on():
    core.set_agreement_check(False)
    try:
        before = core.collective_call_count()
        core.allreduce(np.ones(3, np.float32), "float32", "sum")
        assert core.collective_call_count() - before == 1
    finally:
        core.set_agreement_check(True)
    assert core.agreement_check()


def test_half_conversions_round_trip_and_round_to_nearest_even():
    x = np.array([0, 1, -2.5, 65504, 6e-8, 1e-5, 3.14159, -0.0, np.inf], np.float16)
    np.testing.assert_array_equal(core.allreduce(x, "float16", "max"), x)
    b = np.array([1.0, 1.00390625, 3.0e38, -7.5], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(core.allreduce(b, "bfloat16", "min"), b)


def test_no_tensorflow_was_imported():
    assert "tensorflow" not in sys.modules
