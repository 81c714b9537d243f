"""Keras 2 through tf-keras (TF_USE_LEGACY_KERAS=1) on MaTEx: issue 31 item 2.

The per-rank suite tests/mpi/test_legacy_keras2.py (Horovod's Keras API over
tf-keras models and optimizers, and the transparent path's refusal) on 2 and 3
ranks; an unmodified Horovod Keras 2 script under ``matexrun --horovod``; an
unmodified tf-keras script under the transparent path: refused on 2 ranks,
trained on 1.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mpitools

pytest.importorskip("tf_keras")

ROOT = mpitools.ROOT
SCRIPTS = ROOT / "tests" / "scripts"


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1", **extra)
    env.pop("MATEX_FUSION_THRESHOLD", None)
    return mpitools.launch.launch_env(env)


@pytest.mark.parametrize("nranks", [2, 3])
def test_keras2_horovod_suite(nranks, tmp_path):
    ran = mpitools.run_suite(nranks, ["test_legacy_keras2.py"], tmp_path, env=_env(),
                             timeout=900)
    assert ran >= 10


def test_horovod_keras2_script_trains_unmodified_with_equal_weights(tmp_path):
    out = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "matex.launcher", "--horovod", "-n", "2",
                           str(SCRIPTS / "horovod_keras2_script.py"), out], env=_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    reports = []
    for rank in range(2):
        with open("%s.rank%d.json" % (out, rank)) as f:
            reports.append(json.load(f))
    assert reports[0]["weights"] == reports[1]["weights"]   # bitwise (JSON of float32)
    assert reports[0]["loss"] == reports[1]["loss"]         # MetricAverageCallback
    assert reports[0]["variables"] > 1                      # Adam's slots exist
    assert np.isfinite(reports[0]["loss"]).all() and reports[0]["loss"][-1] < reports[0]["loss"][0]
    assert "finished gradual learning rate warmup" in proc.stdout   # rank 0 only, once
    assert proc.stdout.count("finished gradual learning rate warmup") == 1


def test_transparent_path_refuses_tf_keras_on_two_ranks_and_trains_on_one(tmp_path):
    """A plain tf-keras fit script under matexrun -n 2 stops with the clear error (it would
    otherwise train two separate models); under one process it trains."""
    script = tmp_path / "plain_keras2.py"
    script.write_text(
        "import numpy as np, tensorflow as tf\n"
        "m = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])\n"
        "m.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse')\n"
        "x = np.ones((8, 3), 'float32')\n"
        "m.fit(x, x.sum(1, keepdims=True), epochs=1, verbose=0)\n"
        "print('TRAINED', flush=True)\n")
    proc = subprocess.run([sys.executable, "-m", "matex.launcher", "-n", "2", str(script)],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    assert "TRAINED" not in proc.stdout
    assert "does not distribute" in proc.stderr and "separate models" in proc.stderr
    one = subprocess.run([sys.executable, "-m", "matex", str(script)], env=_env(),
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "TRAINED" in one.stdout
