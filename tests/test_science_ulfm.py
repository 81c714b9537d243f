"""A loss surface survives a rank SIGKILLed mid-grid under ULFM (mpiexec --with-ft ulfm)."""

import json
import os
import sys

import numpy as np

import mpitools
from matex import launcher as launch

TIER = "ulfm"


def test_surface_survives_a_killed_rank(tmp_path):
    out, path = tmp_path / "out.json", tmp_path / "surface.h5"
    proc = mpitools.run_mpi(
        3, [sys.executable, str(mpitools.ROOT / "tests" / "scripts" / "surface_ft.py"),
            str(out), str(path)], mpi_args=launch.ft_mpi_args(), timeout=300,
        env=dict(os.environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"), TF_CPP_MIN_LOG_LEVEL="2"))
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.exists(), log
    result = json.loads(out.read_text())
    assert result["size"] == 2, log                      # the survivors, shrunk
    assert "rank group 2 lost" in proc.stdout, log
    surface = np.array(result["surface"])
    assert not np.isnan(surface).any(), surface          # the lost point was redone
    np.testing.assert_allclose(surface, result["expected"], rtol=1e-12)
    np.testing.assert_array_equal(np.array(result["file"]), surface)
