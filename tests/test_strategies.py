"""tf.distribute strategy scripts (Keras-guide style) under MaTEx, under real mpiexec."""

import json
import os
import subprocess
import sys

import numpy as np

import mpitools

ROOT = mpitools.ROOT
SCRIPT = str(ROOT / "tests" / "scripts" / "strategy_fit.py")
# what a scheduler might leave in the environment: one cluster for every rank
TF_CONFIG = json.dumps({"cluster": {"worker": ["localhost:23456", "localhost:23457"]},
                        "task": {"type": "worker", "index": 0}})
QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def test_strategy_scripts_train_as_one_process(tmp_path):
    # MultiWorkerMirroredStrategy (TF_CONFIG set), MirroredStrategy, OneDeviceStrategy:
    # fit/evaluate/predict; a strategy.run custom loop; a refused strategy. Ranks seed
    # themselves with their rank (different initial weights); one process is rank 0.
    one = str(tmp_path / "one.json")
    subprocess.run([sys.executable, SCRIPT, one], check=True, timeout=400,
                   capture_output=True, env={k: v for k, v in QUIET.items() if k != "TF_CONFIG"})
    ref = json.load(open(one + ".0"))
    many = str(tmp_path / "many.json")
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", SCRIPT, many], timeout=600,
                            env={**os.environ, "TF_CONFIG": TF_CONFIG})
    assert proc.returncode == 0, proc.stderr[-5000:]
    runs = [json.load(open("%s.%d" % (many, r))) for r in range(2)]

    # TF_CONFIG's cluster is dropped before the script runs (said once): each rank is a
    # single worker, with no gRPC peers (with it, construction waits for them for ever)
    assert proc.stdout.count("matex: ignoring TF_CONFIG (a cluster of 2 tasks)") == 1
    for run in runs:
        assert run["tf_config"] is None and run["mwms_cluster"] == {}

    for kind in ("mwms", "mirrored", "onedevice", "loop"):
        expected, got = ref[kind], [run[kind] for run in runs]
        assert expected["replicas"] == got[0]["replicas"] == got[1]["replicas"] == 1
        assert got[1]["initial"] != got[0]["initial"] and got[0]["initial"] == expected["initial"]
        # rank 0's weights everywhere, averaged gradients: bitwise equal ranks, = 1 process
        assert got[1]["weights"] == got[0]["weights"], kind
        assert got[0]["iterations"] == got[1]["iterations"] == expected["iterations"], kind
        for a, b in zip(expected["weights"], got[0]["weights"]):
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6,
                                       err_msg=kind)
        if kind == "loop":
            continue
        for run in got:   # global metrics (sliced data, summed over ranks), full predictions
            assert sorted(run["history"]) == ["loss", "mae", "val_loss", "val_mae"], kind
            for key, values in expected["history"].items():
                np.testing.assert_allclose(run["history"][key], values, rtol=1e-5,
                                           err_msg="%s %s" % (kind, key))
            np.testing.assert_allclose(run["evaluate"], expected["evaluate"], rtol=1e-5,
                                       err_msg=kind)
            np.testing.assert_allclose(run["predict"], expected["predict"], rtol=1e-5,
                                       atol=1e-6, err_msg=kind)

    # a strategy MaTEx does not run across ranks: one error, the same on every rank, at
    # compile and at a custom loop's first apply (raised while tf.function traces the step:
    # TensorFlow reports it as a StagingError quoting it); the script catches it and goes
    # on (no hang, no rank left behind)
    for key, where, kind in (("central", "compile", "StrategyError"),
                             ("central_loop", "optimizer.apply", "StagingError")):
        assert ref[key] == "ok"
        assert runs[0][key] == runs[1][key]
        assert runs[0][key].startswith(kind + ": "), runs[0][key]
        assert ("StrategyError: matex: %s: rank 0: StrategyError: CentralStorageStrategy is "
                "not supported across MaTEx ranks" % where) in runs[0][key], runs[0][key]


PROBE = """
import json, tensorflow as tf
from matex._keras import strategies
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
found = {"default": strategies.problem(strategies.model_strategy(None))}
for name, strategy in (("mirrored_all", tf.distribute.MirroredStrategy()),
                       ("mirrored_one", tf.distribute.MirroredStrategy(["/cpu:1"])),
                       ("onedevice", tf.distribute.OneDeviceStrategy("/cpu:0"))):
    with strategy.scope():
        found[name] = strategies.problem(strategies.model_strategy(None))
print(json.dumps(found))
"""


def test_several_replicas_in_one_process_are_named():
    # MirroredStrategy() over two devices of one process: refused across ranks (MaTEx
    # would average each replica's gradient over the ranks on its own); one device is not
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300, env=QUIET, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["default"] is None and found["mirrored_one"] is None
    assert found["onedevice"] is None
    assert found["mirrored_all"].startswith(
        "MirroredStrategy has 2 replicas in this process (/job:localhost/replica:0/task:0/"
        "device:CPU:0, /job:localhost/replica:0/task:0/device:CPU:1): MaTEx supports one "
        "replica per process; run one rank per device (matexrun -n <devices>)")
