"""Pipeline parallelism on 2 ranks: 2 stages equal one process; bad input fails everywhere."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import matex
from matex.parallel._pipeline import PipelineModel
from matex.parallel._stages import StageBoundary
from pipeline_common import (BATCH, cnn, compile_, mlp, regression, same_everywhere,
                             train_and_compare)

R, N = matex.rank(), matex.size()
pytestmark = pytest.mark.skipif(N != 2, reason="a 2-rank suite")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_mlp_two_stages_equals_one_process(schedule):
    pm, h, _, _ = train_and_compare(lambda: mlp(2), (6,), microbatches=4, schedule=schedule)
    assert same_everywhere(matex.comm(), h.history)
    # each rank keeps its own stage: hidden layers 0-1 on rank 0, 2-3 + output on rank 1
    names = {layer.name for layer in pm.stage.layers if layer.weights}
    assert names == ({"h0", "h1"} if R == 0 else {"h2", "h3", "out"})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cnn_two_stages_equals_one_process(schedule):
    pm, _, ref, _ = train_and_compare(lambda: cnn(2), (8, 8, 2), microbatches=2,
                                      schedule=schedule)
    x, y = regression((8, 8, 2), seed=1)
    np.testing.assert_allclose(pm.evaluate(x, y, batch_size=BATCH, verbose=0),
                               ref.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-4)
    # any number of rows (padded internally), the whole prediction on every rank
    np.testing.assert_allclose(pm.predict(x[:13], batch_size=8, verbose=0),
                               ref.predict(x[:13], verbose=0), rtol=1e-4, atol=1e-6)


def test_parameter_bytes_split():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(64) for _ in range(2)]
                             + [StageBoundary()] + [keras.layers.Dense(64) for _ in range(2)])
    whole = sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    pm = PipelineModel(model, microbatches=2)
    mine = sum(int(np.prod(w.shape)) * 4 for w in pm.trainable_weights)
    assert mine == pm.stage_bytes()
    assert matex.comm().allgather(mine) == [whole // 2, whole // 2]


def test_unbuilt_sequential_builds_only_this_stage():
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(32, name="a"), keras.layers.Dense(32, name="b"),
              StageBoundary(name="cut"), keras.layers.Dense(32, name="c"),
              keras.layers.Dense(3, name="d")]
    model = keras.Sequential(layers)
    pm = PipelineModel(model, microbatches=2)
    pm.build((None, 5))
    built = {layer.name for layer in layers if layer.built and layer.weights}
    assert built == ({"a", "b"} if R == 0 else {"c", "d"})
    compile_(pm)
    x, y = regression((5,), seed=2, rows=32)
    h = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert same_everywhere(matex.comm(), h.history)
    assert pm.predict(x[:5], verbose=0).shape == (5, 3)


def test_balanced_stages_equal_one_process():
    # stages=2: rank 0 measures and picks the cut; every rank follows it
    model = mlp(1, width=16, depth=6)
    pm = PipelineModel(model, microbatches=2, stages=2)
    assert same_everywhere(matex.comm(), pm.plan.starts)
    assert pm.plan.starts[1] in {"h1", "h2", "h3", "h4", "h5"}   # not a degenerate cut
    compile_(pm)
    ref = compile_(mlp(1, width=16, depth=6))
    x, y = regression((6,), seed=3, rows=32)
    h = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    href = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], href.history["loss"], rtol=1e-4)


# ---- bad input: a clear error on every rank, no hang ------------------------------

def test_microbatches_must_divide_the_batch():
    pm = compile_(PipelineModel(mlp(2), microbatches=3))
    x, y = regression((6,), rows=32)
    with pytest.raises(ValueError, match="micro-batches"):
        pm.fit(x, y, batch_size=BATCH, verbose=0)   # 16 rows in 3 parts


def test_more_microbatches_than_rows():
    pm = compile_(PipelineModel(mlp(2), microbatches=8))
    x, y = regression((6,), rows=4)
    with pytest.raises(ValueError, match="micro-batch"):
        pm.fit(x, y, batch_size=4, verbose=0)


def test_stages_must_equal_pipeline_size():
    with pytest.raises(ValueError, match="pipeline has 2 ranks"):
        PipelineModel(mlp(4), microbatches=2)
    with pytest.raises(ValueError, match="pipeline has 2 ranks"):
        PipelineModel(mlp(1), microbatches=2, stages=["h1", "h2"])


def test_more_stages_than_layers():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="only"),
                              StageBoundary(name="b")])
    with pytest.raises(ValueError, match="more stages than"):
        PipelineModel(model)


def test_boundary_inside_a_residual_branch():
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="a")(inp)
    branch = keras.layers.Dense(4, name="b")(h)
    branch = StageBoundary(name="cut")(branch)
    branch = keras.layers.Dense(4, name="c")(branch)
    out = keras.layers.Add(name="add")([h, branch])     # h jumps over the boundary
    with pytest.raises(ValueError, match="do not separate"):
        PipelineModel(keras.Model(inp, out))


def test_a_rank_specific_failure_is_raised_everywhere():
    # only rank 1 gets a bad schedule name: both ranks raise, none waits
    with pytest.raises(ValueError):
        PipelineModel(mlp(2), schedule="gpipe" if R == 0 else "zigzag")


def test_dataset_batch_that_does_not_divide_fails_in_the_step():
    pm = compile_(PipelineModel(mlp(2), microbatches=4))
    x, y = regression((6,), rows=16)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)   # 6, 6, 4 rows
    with pytest.raises(tf.errors.InvalidArgumentError, match="must divide"):
        pm.fit(ds, verbose=0)


def test_an_interrupted_checkpoint_save_leaves_the_previous_one_whole(tmp_path):
    # A save that stops after the stage files, before meta.json (here: meta.json's
    # temporary cannot be created), must leave the previous checkpoint whole: its
    # meta.json names stage files of its own generation, not the half-written ones.
    import os

    from mpi4py import MPI

    directory = MPI.COMM_WORLD.bcast(str(tmp_path / "checkpoint") if R == 0 else None)
    x, y = regression((6,))
    pm = compile_(PipelineModel(mlp(2), microbatches=2))
    pm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    pm.save_checkpoint(directory)
    saved = [np.asarray(v).copy() for v in pm.stage.variables]
    pm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert any(not np.array_equal(np.asarray(v), w) for v, w in zip(pm.stage.variables, saved))
    if R == 0:
        os.mkdir(os.path.join(directory, "meta.json.tmp"))
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(ValueError, match="checkpoint|rank 0 failed"):
        pm.save_checkpoint(directory)
    pm.restore_checkpoint(directory)
    for v, w in zip(pm.stage.variables, saved):
        np.testing.assert_array_equal(np.asarray(v), w)
    # the next save goes through and leaves one generation behind
    if R == 0:
        os.rmdir(os.path.join(directory, "meta.json.tmp"))
    MPI.COMM_WORLD.Barrier()
    pm.save_checkpoint(directory)
    MPI.COMM_WORLD.Barrier()
    assert sorted(os.listdir(directory)) == ["meta.json", "stage0_tensor0.g2.npz",
                                             "stage1_tensor0.g2.npz"]


def test_unseeded_shuffle_feeds_the_same_rows_to_every_stage():
    # x = y = row index through frozen identity stages: the loss is 0 exactly when the
    # last stage's labels are the rows the first stage fed in. Each rank's random state
    # differs (an unseeded script), and shuffle keeps its default (True): before the
    # fix each rank shuffled its own way (loss ~ 10,000).
    keras.utils.set_random_seed(1000 + R)
    tf.random.set_seed(None)

    def identity(name):
        return keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                  trainable=False, name=name)

    model = keras.Sequential([keras.Input((1,)), identity("a"), StageBoundary(name="cut"),
                              identity("b")])
    pm = PipelineModel(model, microbatches=2)
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rows = np.arange(128, dtype="float32").reshape(-1, 1)
    h = pm.fit(rows, rows, batch_size=BATCH, epochs=3, verbose=0)
    assert h.history["loss"] == [0.0, 0.0, 0.0]
    # with validation_split too (taken from the end, as Keras does; not shuffled)
    h = pm.fit(rows, rows, batch_size=BATCH, epochs=2, validation_split=0.25, verbose=0)
    assert h.history["loss"] == [0.0, 0.0] and h.history["val_loss"] == [0.0, 0.0]


def test_a_corrupt_checkpoint_fails_on_every_rank(tmp_path):
    # rank 1's stage file is damaged (a zip header, then garbage): np.load raises
    # zipfile.BadZipFile there. Before, only ValueError/TypeError/NotImplementedError
    # were agreed on: rank 1 raised alone and rank 0 waited for it forever.
    import os

    from mpi4py import MPI

    directory = MPI.COMM_WORLD.bcast(str(tmp_path / "corrupt") if R == 0 else None)
    pm = compile_(PipelineModel(mlp(2), microbatches=2))
    pm.save_checkpoint(directory)
    if R == 1:
        with open(os.path.join(directory, "stage1_tensor0.g1.npz"), "wb") as f:
            f.write(b"PK\x03\x04" + b"\x00garbage" * 8)
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(ValueError, match=r"^rank 1: BadZipFile: "):
        pm.restore_checkpoint(directory)
    # the pipeline still works afterwards: a save and a restore go through everywhere
    pm.save_checkpoint(directory)
    pm.restore_checkpoint(directory)


def test_a_save_that_fails_on_rank_0_fails_on_every_rank():
    # rank 0 writes the whole model; a path it cannot create is one error everywhere
    pm = compile_(PipelineModel(mlp(2), microbatches=2))
    with pytest.raises(RuntimeError, match=r"saving /dev/null/x.keras: rank 0: "):
        pm.save("/dev/null/x.keras")


def test_a_rank_holds_only_its_stage_of_a_built_model():
    # Built from an already-built model, a rank keeps copies of its own stage's layers
    # and no reference to the whole model: once the caller drops it, the other stage's
    # weights are freed (before, the PipelineModel kept the whole model alive while
    # stage_bytes() reported one stage).
    import gc
    import weakref

    model = mlp(2)
    mine = {"h0", "h1"} if R == 0 else {"h2", "h3", "out"}
    others = [weakref.ref(v) for layer in model.layers if layer.weights
              and layer.name not in mine for v in layer.weights]
    expected = {layer.name: [np.asarray(w) for w in layer.weights]
                for layer in model.layers if layer.name in mine}
    assert len(others) == (6 if R == 0 else 4)
    pm = compile_(PipelineModel(model, microbatches=2))
    del model
    gc.collect()
    assert [r for r in others if r() is not None] == []
    control = pm._layout.control   # the pipeline's own communicator, freed with it
    held = {layer.name for layer in pm.stage.layers if layer.weights}
    assert held == mine
    for name, weights in expected.items():   # the copies hold the model's weights
        for a, b in zip(pm.stage.get_layer(name).weights, weights):
            np.testing.assert_array_equal(np.asarray(a), b)
    assert pm.stage_bytes() == sum(w.nbytes for ws in expected.values() for w in ws)
    # it still trains like the whole model and saves it whole
    x, y = regression((6,))
    ref = compile_(mlp(2))
    h = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    href = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], href.history["loss"], rtol=1e-4)
    whole = pm.gather_model(0)
    if R == 0:
        assert [type(layer).__name__ for layer in whole.layers] == [
            "Dense", "Dense", "Identity", "Dense", "Dense", "Dense"]
        np.testing.assert_allclose(whole.predict(x, verbose=0), ref.predict(x, verbose=0),
                                   rtol=1e-4, atol=1e-6)
    del pm, whole, h   # History holds its model
    gc.collect()
    assert control == MPI.COMM_NULL   # before, never freed: one per model built
