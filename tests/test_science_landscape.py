"""matex.science under real mpiexec: surfaces and Hessian spectra on 2 and 3 ranks.

One job per rank count runs the whole suite (tests/mpi/test_science.py), so
TensorFlow starts once per rank count; each check there compares against a
one-process reference computed on every rank.
"""

import pytest

import mpitools


@pytest.mark.parametrize("nranks", [2, 3])
def test_science_suite(nranks, tmp_path):
    env = dict(__import__("os").environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"))
    assert mpitools.run_suite(nranks, ["test_science.py"], tmp_path, env=env, timeout=600) >= 10
