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


def test_data_pipeline_tensor_2x2x2_suite(tmp_path):
    """8 ranks, D x P x T = 2 x 2 x 2: fit equal to one process, 1/(P*T) of the
    parameters per rank, replicas bitwise equal; the saved file (tensor shards
    gathered) loads here with plain Keras and predicts like the 1-process model.
    Then 4 ranks (1 x 2 x 2) resume the 8-rank run's checkpoint: half the data
    replicas, the same second epoch as the 1-process run."""
    import os

    import keras
    import numpy as np

    out = tmp_path / "saved"
    out.mkdir()
    # one test does it all: more than the default 180 s when 8 ranks share 2 loaded cores
    env = dict(os.environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"),
               MATEX_PIPELINE_SAVE_DIR=str(out), MATEX_TEST_TIMEOUT="420")
    assert mpitools.run_suite(8, ["test_parallel_3d.py"], tmp_path / "reports",
                              env=env, timeout=600) == 1
    assert (out / "checkpoint" / "meta.json").exists()
    whole = keras.models.load_model(out / "dp_pp_tp.keras")
    # ordinary Keras layers only: the shards became whole Dense layers
    assert {type(layer).__name__ for layer in whole.layers} == {"Dense", "Identity"}
    assert all(type(layer).__module__.startswith("keras.") for layer in whole.layers)
    assert [tuple(layer.kernel.shape) for layer in whole.layers if layer.weights] == [
        (6, 16), (16, 12), (12, 24), (24, 3)]
    x = np.load(out / "x.npy")
    np.testing.assert_allclose(whole.predict(x, verbose=0), np.load(out / "reference.npy"),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(whole.predict(x, verbose=0), np.load(out / "pipelined.npy"),
                               rtol=1e-5, atol=1e-6)
    # restart from the 8-rank run's checkpoint on 4 ranks: a 1 x 2 x 2 grid
    assert mpitools.run_suite(4, ["test_parallel_3d.py"], tmp_path / "reports4",
                              env=env, timeout=600) == 1
