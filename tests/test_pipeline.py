"""Pipeline parallelism: schedules and stage plans in one process; the suites under mpiexec.

The multi-rank suites (tests/mpi/test_pipeline_2ranks.py, _4ranks.py) compare
every pipelined run with a plain Keras run of the same model and initial
weights computed on each rank (rtol 1e-4).
"""

import os
import sys

import numpy as np
import pytest

import mpitools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "mpi"))


# ---- schedules (pure Python) ----------------------------------------------------

def test_schedules_are_deadlock_free_under_rendezvous_sends():
    from matex.parallel import _schedule

    for schedule in _schedule.SCHEDULES:
        for stages in range(1, 9):
            for micro in range(1, 25):
                for train in (True, False):
                    assert _schedule.simulate(schedule, stages, micro, train) is None, (
                        schedule, stages, micro, train)


def test_unfused_1f1b_would_deadlock():
    # the replay can fail: without the fused send-receive, 1F1B is stuck
    from matex.parallel import _schedule

    plan = [_schedule._candidates("1f1b", 4, p, 8) for p in range(4)]
    for stage in plan:
        for s in stage:
            s.fused_send = s.fused_recv = False
    assert _schedule._replay(plan) is not None


def test_1f1b_keeps_fewer_activations_in_flight():
    from matex.parallel import _schedule

    def peak(schedule, stages, stage, micro):
        alive = most = 0
        for kind, _ in _schedule.order(schedule, stages, stage, micro):
            alive += 1 if kind == "F" else -1
            most = max(most, alive)
        return most

    assert peak("gpipe", 4, 0, 16) == 16
    assert [peak("1f1b", 4, p, 16) for p in range(4)] == [4, 3, 2, 1]
    for p in range(4):   # every micro-batch goes forward, then backward, once
        order = _schedule.order("1f1b", 4, p, 16)
        assert sorted(order) == sorted([("F", m) for m in range(16)]
                                       + [("B", m) for m in range(16)])
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(16))


def test_balance_minimises_the_costliest_stage():
    from matex.parallel._stages import balance

    costs = [1, 1, 1, 1, 4, 1, 1]
    cuts = balance(costs, list(range(1, 7)), 3)
    bounds = [0] + cuts + [7]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == 4 and len(cuts) == 2
    assert balance(costs, [3], 3) is None   # not enough allowed cuts


# ---- plans and the one-process pipeline --------------------------------------------

def test_plans_from_boundaries_names_and_counts():
    import keras

    from matex.parallel._stages import plan
    from pipeline_common import cnn, mlp

    p = plan(mlp(2), None, 2)
    assert p.stage_layers == [["h0", "h1"], ["cut1", "h2", "h3", "out"]]
    p = plan(mlp(1), ["h2"], 2)
    assert p.starts == [None, "h2"]
    p = plan(cnn(4), None, 4)
    assert p.starts == [None, "cut1", "cut2", "cut3"]
    p = plan(mlp(1, width=8, depth=6), 3, 3, measure=lambda m: ([1] * 7, [1.0] * 7))
    assert len(p.starts) == 3
    with pytest.raises(ValueError, match="more stages than layers"):
        plan(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]), 3, 3)
    with pytest.raises(ValueError, match="does not have"):
        plan(mlp(1), ["nope"], 2)


def test_one_process_pipeline_equals_plain_keras():
    """P = 1: the StageBoundary is an identity and M micro-batches accumulate exactly."""
    import keras

    from matex.parallel._pipeline import PipelineModel
    from pipeline_common import BATCH, compile_, mlp, regression

    x, y = regression((6,))
    ref = compile_(mlp(2))
    pm = compile_(PipelineModel(mlp(2), microbatches=4, stages=["cut1"]))
    assert isinstance(pm, keras.Model)
    h = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    href = ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], href.history["loss"], rtol=1e-4)
    for a, b in zip(pm.trainable_weights, ref.trainable_weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


# ---- under mpiexec -----------------------------------------------------------------

def test_pipeline_two_ranks(tmp_path):
    assert mpitools.run_suite(2, ["test_pipeline_2ranks.py"], tmp_path, timeout=600) >= 12


def test_pipeline_four_ranks(tmp_path):
    import keras

    out = tmp_path / "saved"
    out.mkdir()
    env = dict(os.environ, MATEX_PIPELINE_SAVE_DIR=str(out))
    # + op="adasum" on 4 ranks (its power-of-two tree) and process sets of 2 and 3 ranks,
    # in the same launch
    assert mpitools.run_suite(4, ["test_pipeline_4ranks.py", "test_adasum.py",
                                  "test_process_sets.py"],
                              tmp_path / "reports", timeout=600, env=env) >= 26
    # trained on 4 ranks, loaded here in one process with plain Keras: same predictions
    whole = keras.models.load_model(out / "pipelined.keras")
    np.testing.assert_allclose(whole.predict(np.load(out / "x.npy"), verbose=0),
                               np.load(out / "predictions.npy"), rtol=1e-5, atol=1e-6)


# ---- custom layers load after `import matex` (issue #24 item 6) --------------------

_LOAD = """
import json, sys
import numpy as np
order = sys.argv[1]
if order == "matex-first":
    import matex
    import keras
elif order == "matex-then-tensorflow":   # TensorFlow loads Keras itself
    import matex
    import tensorflow
    import keras
else:
    import keras
    import matex
loaded = {}
m = keras.saving.load_model(sys.argv[2])          # StageBoundary: no other matex import
loaded["boundary"] = [type(layer).__name__ for layer in m.layers]
loaded["boundary_predictions"] = m.predict(np.load(sys.argv[4]), verbose=0).tolist()
import matex.parallel as mp
mp.grid(tensor=1)                                  # the tensor-parallel layers need a grid
m = keras.saving.load_model(sys.argv[3])
loaded["tensor"] = [type(layer).__name__ for layer in m.layers]
loaded["tensor_predictions"] = m.predict(np.load(sys.argv[5]), verbose=0).tolist()
print(json.dumps(loaded))
"""


def test_every_custom_layer_loads_after_import_matex(tmp_path):
    """A saved model holding each MaTEx layer (StageBoundary; ColumnParallelDense,
    RowParallelDense, ParallelConv2D) loads with keras.saving.load_model in a fresh
    process after only `import matex` (before or after `import keras`, or before
    `import tensorflow`, which imports Keras) and predicts as
    saved. Before the fix: "Could not locate class 'StageBoundary'"."""
    import json
    import subprocess

    import keras

    import matex.parallel as mp
    from matex.parallel._stages import StageBoundary

    keras.utils.set_random_seed(1)
    boundary = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="a"),
                                 StageBoundary(name="cut"), keras.layers.Dense(2, name="b")])
    g = mp.grid(tensor=1)
    try:
        inp = keras.Input((6, 6, 2))
        h = mp.ParallelConv2D(4, 3, padding="same", activation="relu", name="conv")(inp)
        h = keras.layers.Flatten()(h)
        h = mp.ColumnParallelDense(8, gather_output=False, activation="tanh", name="col")(h)
        out = mp.RowParallelDense(3, input_is_parallel=True, name="row")(h)
        tensor = keras.Model(inp, out)
        xb = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
        xt = np.random.default_rng(1).normal(size=(5, 6, 6, 2)).astype("float32")
        expected_b = boundary.predict(xb, verbose=0)
        expected_t = tensor.predict(xt, verbose=0)
        boundary.save(tmp_path / "boundary.keras")
        tensor.save(tmp_path / "tensor.keras")
    finally:
        g.close()
    np.save(tmp_path / "xb.npy", xb)
    np.save(tmp_path / "xt.npy", xt)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    for order in ("matex-first", "matex-then-tensorflow", "keras-first"):
        proc = subprocess.run(
            [sys.executable, "-c", _LOAD, order, str(tmp_path / "boundary.keras"),
             str(tmp_path / "tensor.keras"), str(tmp_path / "xb.npy"),
             str(tmp_path / "xt.npy")],
            capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, "%s: %s" % (order, proc.stderr[-3000:])
        got = json.loads(proc.stdout.splitlines()[-1])
        assert got["boundary"] == ["Dense", "StageBoundary", "Dense"], order
        assert got["tensor"] == ["InputLayer", "ParallelConv2D", "Flatten",
                                 "ColumnParallelDense", "RowParallelDense"], order
        np.testing.assert_allclose(got["boundary_predictions"], expected_b, rtol=1e-6)
        np.testing.assert_allclose(got["tensor_predictions"], expected_t, rtol=1e-5,
                                   atol=1e-6)


def test_pipeline_example_exits_under_matexrun(tmp_path):
    """examples/pipeline_mlp.py, its docstring's command (cheaper: 1 epoch of 512 rows),
    runs to the end in bounded time and reloads what it saved. Before the fix rank 0
    alone called keras.models.load_model, which is collective under matexrun: the run
    trained, then never exited."""
    import signal
    import subprocess

    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    cmd = [matexrun, "-n", "4", os.path.join(ROOT, "examples", "pipeline_mlp.py"),
           "--data", "2", "--epochs", "1", "--rows", "512"]
    env = dict(os.environ, TMPDIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # matexrun, mpiexec and every rank
        out, err = proc.communicate()
        raise AssertionError("the example did not exit in 240 s:\n%s\n%s"
                             % (out[-2000:], err[-3000:]))
    assert proc.returncode == 0, err[-3000:]
    assert "2 stage(s) x 2 replica(s)" in out
    assert "reloaded model predicts the same: True" in out
    assert (tmp_path / "pipeline_mlp.keras").exists()
