"""The multi-rank suites under real mpiexec: 2 and 3 ranks, shared memory and TCP."""

import pytest

import mpitools

TCP = ["--mca", "btl", "tcp,self"]


@pytest.mark.parametrize("nranks,mpi_args", [(2, []), (3, []), (2, TCP)],
                         ids=["2-ranks", "3-ranks", "2-ranks-tcp"])
def test_collectives_and_training(nranks, mpi_args, tmp_path):
    count = mpitools.run_suite(nranks, ["test_collectives.py", "test_training.py",
                                        "test_adasum.py",    # after a traced optimizer step
                                        "test_process_sets.py"],
                               tmp_path, mpi_args=mpi_args)
    assert count >= 140


@pytest.mark.parametrize("nranks", [2, 3])
def test_core_without_tensorflow(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_core.py"], tmp_path) >= 25


@pytest.mark.parametrize("nranks", [2, 3])
def test_keras_api(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_keras_api.py", "test_runtime.py",
                                       "test_horovod_training.py", "test_horovod_elastic.py"],
                              tmp_path) >= 20
