"""Data x pipeline x tensor parallelism at once on 8 ranks (a 2 x 2 x 2 grid).

One model: stage 0 = ColumnParallelDense(gather_output=False) + RowParallelDense,
a StageBoundary, stage 1 = ColumnParallelDense(gather_output=True) +
RowParallelDense(input_is_parallel=False); trained with ``PipelineModel.fit``
and compared with the same model made of plain Dense layers trained in one
process (world rank 0 trains it, every rank compares, rtol 1e-4). Then the
pipeline is saved with its tensor shards gathered into plain Dense layers;
the outer test (tests/test_parallel.py) loads the file with plain Keras in
its own process and compares predictions with the reference.

The 8-rank run also writes a checkpoint after its first epoch; the outer test
then runs this file on 4 ranks, a 1 x 2 x 2 grid (half the data replicas),
which restores it and trains the second epoch: the same loss and weights as
the 1-process run's second epoch.
"""

import os

import keras
import numpy as np
import pytest

import matex
import matex.parallel as mp
from matex.parallel._pipeline import PipelineModel

WORLD, SIZE = matex.rank(), matex.size()
D, P, T = 2, 2, 2
BATCH, ROWS, M = 16, 32, 2
pytestmark = pytest.mark.skipif(SIZE not in (D * P * T, P * T),
                                reason="an 8-rank (D x P x T) or 4-rank (1 x P x T) suite")

# name: (kind, units, activation, extra arguments of the parallel layer)
LAYERS = [("c0", "column", 16, "tanh", dict(gather_output=False)),
          ("r0", "row", 12, "tanh", dict(input_is_parallel=True)),
          None,   # the stage boundary
          ("c1", "column", 24, "tanh", dict(gather_output=True)),
          ("r1", "row", 3, None, dict(input_is_parallel=False))]


def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def _build(parallel, grid=None):
    """The model, tensor-parallel (an unbuilt Sequential: each rank builds only its
    stage) or plain (built, for one process); the same seeded initial weights."""
    layers = [] if parallel else [keras.Input((6,))]
    for i, spec in enumerate(LAYERS):
        if spec is None:
            layers.append(mp.StageBoundary(name="cut"))
            continue
        name, kind, units, activation, extra = spec
        common = dict(activation=activation, kernel_initializer=_init(10 + i),
                      bias_initializer=_init(20 + i), name=name)
        if not parallel:
            layers.append(keras.layers.Dense(units, **common))
        elif kind == "column":
            layers.append(mp.ColumnParallelDense(units, grid=grid, **common, **extra))
        else:
            layers.append(mp.RowParallelDense(units, grid=grid, **common, **extra))
    return keras.Sequential(layers)


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(7)
    return (rng.normal(size=(ROWS, 6)).astype("float32"),
            rng.normal(size=(ROWS, 3)).astype("float32"))


def _shard(name, full, t):
    """This tensor rank's slice of a plain layer's weights [kernel, bias]."""
    kind = next(s[1] for s in LAYERS if s is not None and s[0] == name)
    kernel, bias = full
    if kind == "column":
        n = kernel.shape[1] // T
        return [kernel[:, t * n:(t + 1) * n], bias[t * n:(t + 1) * n]]
    n = kernel.shape[0] // T
    return [kernel[t * n:(t + 1) * n], bias]


def _reference(x, y):
    """The 1-process run (2 epochs) on world rank 0, shared with every rank: weights by
    layer, history, predictions, parameter bytes."""
    reference = None
    if WORLD == 0:
        ref = _compile(_build(False))
        history = ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
        reference = ({layer.name: [np.asarray(w) for w in layer.weights]
                      for layer in ref.layers}, history, ref.predict(x, verbose=0),
                     sum(int(np.prod(w.shape)) * 4 for w in ref.weights))
    return matex.comm().bcast(reference, root=0)


def _check_shards(pm, ref_weights, g):
    for layer in pm.stage.layers:
        if not layer.weights:
            continue
        expected = _shard(layer.name, ref_weights[layer.name], g.tensor_rank)
        for a, b in zip(layer.weights, expected):
            np.testing.assert_allclose(
                np.asarray(a), b, rtol=1e-4, atol=1e-6,
                err_msg="%s on rank %d %s" % (a.path, WORLD, (g.data_rank, g.pipeline_rank,
                                                                g.tensor_rank)))


@pytest.mark.skipif(SIZE != D * P * T, reason="the 8-rank part")
def test_data_pipeline_tensor_2x2x2_fit_equals_one_process_and_saves():
    x, y = _data()
    out = os.environ["MATEX_PIPELINE_SAVE_DIR"]
    ref_weights, ref_history, ref_pred, whole_bytes = _reference(x, y)

    with mp.grid(data=D, pipeline=P, tensor=T) as g:
        pm = PipelineModel(_build(True, g), microbatches=M, schedule="1f1b", grid=g)
        pm.build((None, 6))
        _compile(pm)
        # each rank holds only its stage, split T ways: about 1/(P*T) of the model
        held = pm.stage_bytes()
        stage_names = [s[0] for s in LAYERS[:2]] if g.pipeline_rank == 0 else \
            [s[0] for s in LAYERS[3:]]
        assert sorted(layer.name for layer in pm.stage.layers if layer.weights) == stage_names
        assert held == mp.parameter_bytes(pm.stage)
        ratio = held / whole_bytes
        assert abs(ratio * P * T - 1) < 0.15, (ratio, held, whole_bytes)
        # the P x T ranks of a replica hold the model once, but for each row layer's bias
        replicated = 4 * sum(s[2] for s in LAYERS if s is not None and s[1] == "row")
        assert sum(g.world_comm.allgather(held)[:P * T]) == whole_bytes + (T - 1) * replicated

        # two epochs, with a checkpoint between them (for the 4-rank restart below)
        first = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        pm.save_checkpoint(os.path.join(out, "checkpoint"))
        second = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        for key in ("loss", "mae"):
            np.testing.assert_allclose(first[key] + second[key], ref_history[key], rtol=1e-4)
        _check_shards(pm, ref_weights, g)
        # the data replicas of a (stage, shard) hold bitwise-equal weights
        mine = b"".join(np.asarray(v).tobytes() for v in pm.stage.variables)
        assert len(set(g.data_comm.allgather(mine))) == 1
        # the tensor group's shards differ (the split is real)
        assert len(set(g.tensor_comm.allgather(mine))) == T
        predicted = pm.predict(x, verbose=0)
        np.testing.assert_allclose(predicted, ref_pred, rtol=1e-4, atol=1e-5)

        # save: shards gathered into plain Dense layers, one file, written by world rank 0
        path = os.path.join(out, "dp_pp_tp.keras")
        pm.save(path)
        assert os.path.exists(path)   # save returns once rank 0 has written
    if WORLD == 0:
        np.save(os.path.join(out, "x.npy"), x)
        np.save(os.path.join(out, "reference.npy"), ref_pred)
        np.save(os.path.join(out, "pipelined.npy"), predicted)


@pytest.mark.skipif(SIZE != P * T, reason="the 4-rank part")
def test_restart_on_half_the_data_replicas_from_the_checkpoint():
    """The 8-rank run's checkpoint (after epoch 1, D = 2) resumed on a 1 x 2 x 2 grid: its
    second epoch equals the 1-process run's (Adam's moments and step count restored)."""
    x, y = _data()
    out = os.environ["MATEX_PIPELINE_SAVE_DIR"]
    ref_weights, ref_history, _, _ = _reference(x, y)
    with mp.grid(data=1, pipeline=P, tensor=T) as g:
        pm = PipelineModel(_build(True, g), microbatches=M, grid=g)
        pm.build((None, 6))
        _compile(pm)
        with pytest.raises(ValueError, match="no checkpoint"):
            pm.restore_checkpoint(os.path.join(out, "nowhere"))
        pm.restore_checkpoint(os.path.join(out, "checkpoint"))
        history = pm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        for key in ("loss", "mae"):
            np.testing.assert_allclose(history[key], ref_history[key][1:], rtol=1e-4)
        _check_shards(pm, ref_weights, g)
