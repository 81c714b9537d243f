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


def test_loss_surface_benchmark_quick(tmp_path):
    """benchmarks/loss_surface.py --quick: a finite table, both schemes give the same surface."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "surface.json"
    proc = subprocess.run(
        [sys.executable, str(mpitools.ROOT / "benchmarks" / "loss_surface.py"), "--quick",
         "--json", str(out)], cwd=mpitools.ROOT, capture_output=True, text=True, timeout=400,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert set(results) == {"1", "2"}
    for r in results.values():
        assert r["points"] == 25 and r["dynamic"] > 0 and r["static"] > 0
        assert r["max_difference"] < 1e-5
    assert "| 2     | static" in proc.stdout
    assert "both schemes give the same surface: MET" in proc.stdout


def test_a_killed_surface_job_resumes_to_the_uninterrupted_file(tmp_path):
    """The job SIGKILLed midway (rank 0, the file's writer, dies after the 7th point): a
    rerun on the same file computes the rest and equals a surface computed in one go."""
    import json
    import os
    import sys

    import numpy as np

    script = str(mpitools.ROOT / "tests" / "scripts" / "surface_resume.py")
    path, out = tmp_path / "surface.h5", tmp_path / "out.json"
    env = dict(os.environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"), TF_CPP_MIN_LOG_LEVEL="2")
    killed = mpitools.run_mpi(2, [sys.executable, script, str(path), "kill"], env=env,
                              timeout=300)
    assert killed.returncode != 0 and path.exists()
    import h5py

    with h5py.File(path, "r") as f:
        assert int(np.count_nonzero(~np.isnan(f["loss"][...]))) == 7   # left by the killed job
    resumed = mpitools.run_mpi(2, [sys.executable, script, str(path), "resume", str(out)],
                               env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["d1_equal"] and result["d2_equal"]
    assert result["computed_on_resume"] == 25 - 7   # only the missing points
    resumed_loss, reference = np.array(result["resumed"]), np.array(result["reference"])
    assert not np.isnan(resumed_loss).any()
    np.testing.assert_array_equal(resumed_loss, reference)
