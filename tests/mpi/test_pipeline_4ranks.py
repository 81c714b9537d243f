"""Pipeline parallelism on 4 ranks: 4 stages, 2 x 2 data x pipeline, saving the whole model."""

import os

import keras
import numpy as np
import pytest

import matex
from matex.parallel import _grid
from matex.parallel._pipeline import PipelineModel
from pipeline_common import (BATCH, cnn, compile_, mlp, regression, same_everywhere,
                             train_and_compare)

R, N = matex.rank(), matex.size()
pytestmark = pytest.mark.skipif(N != 4, reason="a 4-rank suite")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_mlp_four_stages_equals_one_process(schedule):
    pm, h, _, _ = train_and_compare(lambda: mlp(4), (6,), microbatches=4, schedule=schedule)
    assert same_everywhere(matex.comm(), h.history)
    names = {layer.name for layer in pm.stage.layers if layer.weights}
    assert names == [{"h0"}, {"h1"}, {"h2"}, {"h3", "out"}][R]


def test_cnn_four_stages_equals_one_process():
    train_and_compare(lambda: cnn(4), (8, 8, 2), microbatches=4, schedule="1f1b")


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_data_x_pipeline_2x2_equals_one_process(schedule):
    with _grid.grid(data=2, pipeline=2) as g:
        assert matex.size() == 2   # slot 0 is the data communicator while the grid is open
        pm, h, _, _ = train_and_compare(lambda: mlp(2), (6,), microbatches=2,
                                        schedule=schedule, grid=g)
        # the two replicas of a stage hold bitwise-equal weights
        mine = b"".join(np.asarray(v).tobytes() for v in pm.stage.variables)
        assert len(set(g.data_comm.allgather(mine))) == 1
    assert same_everywhere(matex.comm(), h.history)   # the grid closed: every rank again


def test_save_on_four_ranks_loads_in_one_process():
    out = os.environ["MATEX_PIPELINE_SAVE_DIR"]
    pm = compile_(PipelineModel(mlp(4), microbatches=2))
    x, y = regression((6,), seed=4)
    pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(out, "pipelined.keras")
    pm.save(path)
    expected = pm.predict(x, verbose=0)
    if R == 0:
        np.save(os.path.join(out, "x.npy"), x)
        np.save(os.path.join(out, "predictions.npy"), expected)
        # the file loads with plain Keras here too, with every stage's weights
        whole = keras.models.load_model(path)
        np.testing.assert_allclose(whole.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
    assert os.path.exists(path)   # save returns once rank 0 has written


def test_stage_count_mismatch_on_four_ranks():
    with pytest.raises(ValueError, match="pipeline has 4 ranks"):
        PipelineModel(mlp(2))
    with pytest.raises(ValueError, match="grid"):
        _grid.grid(data=3, pipeline=2)   # 6 != 4 ranks
    with pytest.raises(ValueError, match="micro"):
        PipelineModel(cnn(4), microbatches=0)
