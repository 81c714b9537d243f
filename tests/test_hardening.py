"""Holes found by running unmodified user scripts under mpiexec (one test per hole)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mpitools

SCRIPTS = mpitools.ROOT / "tests" / "scripts"


def _compare(one, many, rtol=1e-4):
    """Every rank's result equals the 1-process one (floats to ``rtol``)."""
    for run in many:
        assert sorted(run) == sorted(one)
        for key in one:
            a, b = one[key], run[key]
            if isinstance(a, dict):
                for k in a:
                    np.testing.assert_allclose(b[k], a[k], rtol=rtol, atol=1e-6, err_msg=key)
            elif key == "weights":
                for u, v in zip(a, b):
                    np.testing.assert_allclose(v, u, rtol=rtol, atol=1e-6, err_msg=key)
            else:
                np.testing.assert_allclose(np.array(b, dtype=float), np.array(a, dtype=float),
                                           rtol=rtol, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("nranks", [2, 3])
def test_predict_evaluate_fit_on_fewer_rows_than_ranks(tmp_path, nranks):
    script = str(SCRIPTS / "few_rows.py")
    out = str(tmp_path / "r")
    subprocess.run([sys.executable, script, out + "-one", str(nranks)], check=True,
                   timeout=300, capture_output=True)
    one = json.load(open(out + "-one.0"))
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", script, out, str(nranks)],
                            timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    many = [json.load(open("%s.%d" % (out, r))) for r in range(nranks)]
    _compare(one, many)
    # every rank holds the full predictions (one row each, two classes)
    for run in many:
        assert np.array(run["predict1"]).shape == (1, 2)
        assert np.array(run["one_at_a_time"]).shape == (3, 1, 2)


def test_import_on_some_ranks_only_is_an_error_not_a_hang(tmp_path):
    proc = mpitools.run_mpi(2, [sys.executable, str(SCRIPTS / "import_on_one_rank.py")],
                            env={**os.environ, "MATEX_START_TIMEOUT": "5"}, timeout=180)
    assert proc.returncode != 0
    assert "waited 5 s for the other ranks to start MaTEx" in proc.stderr, proc.stderr[-3000:]
    assert "imported" not in proc.stdout



def test_mpi_without_thread_multiple_is_an_error_naming_the_fix():
    # MaTEx's threads call MPI concurrently: at a lower thread level that was a warning only
    code = ("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            "import matex\n"
            "try:\n"
            "    matex.init()\n"
            "except RuntimeError as exc:\n"
            "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("matex: MPI provides MPI_THREAD_SERIALIZED, but MaTEx's "
                                  "threads"), proc.stdout + proc.stderr[-2000:]
    assert "MPICH_MAX_THREAD_SAFETY=multiple" in proc.stdout
