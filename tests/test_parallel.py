"""matex.parallel under real mpiexec: p2p ops, the grid and tensor parallelism on
2 ranks (T=2) and 4 ranks (a 2 x 2 data x tensor grid), each equal to a
1-process Keras reference."""

import pytest

import mpitools


@pytest.mark.parametrize("nranks", [2, 4], ids=["2-ranks-tp", "4-ranks-2x2-dp-tp"])
def test_parallel_tensor_suite(nranks, tmp_path):
    import os

    env = dict(os.environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"))
    assert mpitools.run_suite(nranks, ["test_parallel_tp.py"], tmp_path / "reports",
                              env=env, timeout=600) >= 15
