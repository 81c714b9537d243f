"""Layers under real mpiexec: synchronised BatchNormalization, per-rank dropout
streams; and a quiet start-up of ``python -m matex``."""

import json
import os
import re
import subprocess
import sys

import numpy as np

import mpitools

ROOT = mpitools.ROOT
SCRIPTS = ROOT / "tests" / "scripts"


def _single(tmp_path, script, *args):
    """``script`` run alone (no mpiexec, no python -m matex): its result."""
    out = str(tmp_path / ("one-%s.json" % script))
    subprocess.run([sys.executable, str(SCRIPTS / script), out] + list(args), check=True,
                   timeout=600, capture_output=True,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    return json.load(open(out + ".0"))


def _distributed(tmp_path, nranks, script, *args):
    """``script`` under mpiexec and python -m matex: every rank's result."""
    out = str(tmp_path / ("many%d-%s.json" % (nranks, script)))
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", str(SCRIPTS / script), out]
                            + list(args), timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.load(open("%s.%d" % (out, r))) for r in range(nranks)]


def _close(actual, expected, what, atol=1e-6):
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=atol, err_msg=what)


# ---- BatchNormalization(synchronized=True) -----------------------------------

def test_synchronized_batchnorm_matches_one_process(tmp_path):
    # fit: 61 samples in global batches of 15 on 2 ranks: slices of 7 and 8
    # rows (count-weighted statistics, row-weighted gradients through the
    # statistics' allreduce) and a last batch of 1 row (rank 0's slice empty).
    # loop/eager: GradientTape + apply_gradients on matex.shard (slices of 8),
    # in a tf.function / eagerly.
    one = _single(tmp_path, "sync_batchnorm.py")
    many = _distributed(tmp_path, 2, "sync_batchnorm.py")
    for part in ("fit", "loop", "eager"):
        ref, runs = one[part], [m[part] for m in many]
        # the global batch's statistics on every rank: moving statistics and
        # weights identical (bitwise) without any averaging (the loop has none)
        assert runs[1]["moving"] == runs[0]["moving"], part
        assert runs[1]["weights"] == runs[0]["weights"], part
        _close(runs[0]["weights"], ref["weights"], part + " weights")
        # (atol: a moving mean near 0 of inputs of size ~5 is a difference of
        # large sums; 1e-5 is 2e-6 of the inputs' scale)
        _close(runs[0]["moving"], ref["moving"], part + " moving statistics", atol=1e-5)
        np.testing.assert_allclose(runs[0]["loss"], ref["loss"], rtol=1e-4, err_msg=part)
    # Keras alone under MaTEx (the original function put back): per-rank
    # statistics, not the single-process training
    unpatched = many[0]["unpatched"]
    assert not np.allclose(np.concatenate([np.ravel(v) for v in unpatched["moving"]]),
                           np.concatenate([np.ravel(v) for v in one["fit"]["moving"]]),
                           rtol=1e-3, atol=1e-5)
    assert not np.allclose(unpatched["loss"], one["fit"]["loss"], rtol=1e-3)


# ---- in-step randomness --------------------------------------------------------

def test_dropout_noise_and_augmentation_are_per_rank_generators_stay_equal(tmp_path):
    runs = [m["masks"] for m in _distributed(tmp_path, 2, "dropout_streams.py", "masks")]
    x = np.array(runs[0]["input"])
    seen = [{k: np.array(v) for k, v in run["seen"].items()} for run in runs]  # steps, rows, 64
    assert seen[0]["dropout"].shape == (100, 8, 64)
    for r in range(2):
        # a step's Dropout(0.5) output: 0 (dropped) or 2x (kept); over 100
        # steps x 8 rows x 64 units the dropped fraction is 0.5 +- 0.0022
        # (1 sigma): 0.5 +- 0.015 is a 6.8 sigma bound
        dropout = seen[r]["dropout"]
        assert np.all((dropout == 0) | np.isclose(dropout, 2 * x)), r
        assert abs((dropout == 0).mean() - 0.5) < 0.015, (r, (dropout == 0).mean())
        flipped = (seen[r]["flip"] != x).any(-1)             # steps, rows
        assert abs(flipped.mean() - 0.5) < 0.1, (r, flipped.mean())
    # independent across ranks: the ranks' masks agree on about half of the
    # units (identical masks: all of them), their noise nowhere, their flips
    # on about half of the images (800 decisions: 0.5 +- 0.018), their
    # noise is uncorrelated
    agree = (seen[0]["dropout"] == seen[1]["dropout"]).mean()
    assert abs(agree - 0.5) < 0.03, agree
    noise = [(s["noise"] - x).ravel() for s in seen]        # 51200 N(0, 1) draws per rank
    assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.03   # 1 sigma: 0.0044
    flips = [(s["flip"] != x).any(-1) for s in seen]
    assert abs((flips[0] == flips[1]).mean() - 0.5) < 0.1
    # the generators' state variables stay bitwise equal on every rank
    assert len(runs[0]["generators"]) == 3
    assert runs[1]["generators"] == runs[0]["generators"]
    # TensorFlow's own tf.random.normal in a layer, every rank seeded alike:
    # independent draws per rank (they were equal), N(0, 1) on each
    tf_noise = [np.array(run["tf_native"]) - 1.0 for run in runs]   # 10 steps, 8 rows, 64
    assert tf_noise[0].shape == (10, 8, 64)
    assert abs(np.corrcoef(tf_noise[0].ravel(), tf_noise[1].ravel())[0, 1]) < 0.06  # 4.3 sigma
    for noise_r in tf_noise:
        assert abs(noise_r.std() - 1.0) < 0.05 and abs(noise_r.mean()) < 0.05
    # without the patch: the ranks' masks are the same
    unpatched = [{k: np.array(v) for k, v in m["unpatched"]["seen"].items()} for m in runs]
    assert (unpatched[0]["dropout"] == unpatched[1]["dropout"]).all()
    assert (unpatched[0]["noise"] == unpatched[1]["noise"]).all()


def test_dropout_training_reaches_the_one_process_loss(tmp_path):
    # Rank 1's dropout masks differ from those of one process, so the two
    # runs are two draws of the same training (same data, same initial
    # weights); their held-out losses (no dropout) must agree within the
    # spread of such draws. Measured (one process, dropout seeds 1..11):
    # held-out MSE mean 0.123, std 0.0087, range 0.110-0.141; 2 ranks, seeds
    # 1..5: 0.114-0.126. Two independent draws differ by std 0.012 (sqrt(2) x
    # 0.0087): 0.045 is 3.7 of those. (Seeds are fixed: the run is
    # deterministic on one platform.)
    one = _single(tmp_path, "dropout_streams.py", "regression", "1")["regression"]
    many = [m["regression"] for m in _distributed(tmp_path, 2, "dropout_streams.py",
                                                  "regression", "1")]
    assert many[1]["heldout"] == many[0]["heldout"]
    assert abs(many[0]["heldout"] - one["heldout"]) < 0.045, (many[0]["heldout"],
                                                             one["heldout"])
    # and training did learn (the variance of the target is about 0.9)
    assert many[0]["heldout"] < 0.3


# ---- start-up output ------------------------------------------------------------

# TensorFlow's C++ start-up notices, INFO lines in absl's format: cpu_feature_guard's
# instruction-set note (2 lines), oneDNN's notice. absl prefixes the first
# line TensorFlow logs with "WARNING: All log messages before
# absl::InitializeLog() ...", a notice of its own when nothing else is worth showing.
STARTUP_NOTICES = re.compile(
    r"^I\d{4} \d\d:\d\d:\d\d|cpu_feature_guard|oneDNN custom operations|"
    r"rebuild TensorFlow with the appropriate compiler flags", re.M)


def _run(tmp_path, script_text, level=None):
    """``script_text`` on 2 ranks under python -m matex; TF_CPP_MIN_LOG_LEVEL unset or ``level``."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    env = mpitools.launch.launch_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)        # as in a user's shell
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    cmd = mpitools.launch.mpiexec_command(2, [sys.executable, "-m", "matex", str(script)])
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


SUM_SCRIPT = ("import os\n"
              "import tensorflow as tf\n"
              "print('sum', int(tf.reduce_sum(tf.ones(3))), os.environ['TF_CPP_MIN_LOG_LEVEL'])\n")


def test_python_m_matex_hides_tensorflow_startup_notices(tmp_path):
    quiet = _run(tmp_path, SUM_SCRIPT)
    assert quiet.returncode == 0, quiet.stderr[-5000:]
    output = quiet.stdout + quiet.stderr
    assert not STARTUP_NOTICES.search(output) and "absl::InitializeLog" not in output, output
    assert quiet.stdout.splitlines() == ["sum 3 1"]          # rank 0 only
    # a value the user set is kept (here it brings the notices back, on CPUs
    # for which TensorFlow has any)
    loud = _run(tmp_path, SUM_SCRIPT, level="0")
    assert loud.returncode == 0, loud.stderr[-5000:]
    assert loud.stdout.splitlines() == ["sum 3 0"]


def test_the_startup_filter_drops_only_info_notices():
    # fd-level writes inside the filter, as TensorFlow's C++ makes them while it loads
    code = (
        "import os, sys\n"
        "from matex._quiet import without_startup_notices\n"
        "with without_startup_notices():\n"
        "    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called "
        "are written to STDERR\\n')\n"
        "    os.write(2, b'I0000 00:00:1795507254.554787    2299 port.cc:153] oneDNN custom "
        "operations are on.\\n')\n"
        "    os.write(2, b'W0000 00:00:1795507254.554787    2299 op.cc:1] a real warning\\n')\n"
        "    os.write(2, b'x' * 200000 + b'\\n')\n"   # more than a pipe holds
        "    print('from python', file=sys.stderr)\n"
        "print('after', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "W0000 00:00:1795507254.554787    2299 op.cc:1] a real warning", "x" * 200000,
        "from python", "after"]


def test_a_fatal_line_before_an_abort_in_the_filter_reaches_stderr():
    """TensorFlow's import aborting (a CPU without AVX, a CUDA check) after its fatal line:
    the line was held in the filter's pipe and lost with the process; it now passes."""
    code = (
        "import os\n"
        "from matex._quiet import without_startup_notices\n"
        "with without_startup_notices():\n"
        "    os.write(2, b'I0000 00:00:1795507254.554787    2299 port.cc:153] oneDNN custom "
        "operations are on.\\n')\n"
        "    os.write(2, b'F0000 00:00:1795507254.6 2299 cpu_feature_guard.cc:1] The "
        "TensorFlow library was compiled to use AVX instructions\\n')\n"
        "    os.abort()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -6
    assert proc.stderr.splitlines() == [
        "F0000 00:00:1795507254.6 2299 cpu_feature_guard.cc:1] The TensorFlow library was "
        "compiled to use AVX instructions"], proc.stderr


def test_python_m_matex_still_shows_a_rank_s_error(tmp_path):
    proc = _run(tmp_path, (
        "import os\n"
        "import tensorflow as tf\n"
        "if os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
        "    tf.debugging.check_numerics(tf.constant([1.0]) / 0.0, 'rank one divided by zero')\n"
        "print('rank 0 done')\n"))
    assert proc.returncode != 0
    assert "[rank 1] Traceback (most recent call last)" in proc.stderr, proc.stderr[-5000:]
    assert "rank one divided by zero" in proc.stderr
    # TensorFlow's own warning about the failed op is still shown, the notices are not
    assert re.search(r"^W\d{4} .*rank one divided by zero", proc.stderr, re.M), proc.stderr
    assert not STARTUP_NOTICES.search(proc.stdout + proc.stderr)
