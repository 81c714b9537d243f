"""Under ULFM a pipelined or tensor-parallel run does not recover: a lost rank ends the job
with its name."""

import sys

import mpitools
from matex import launcher as launch

TIER = "ulfm"
SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "pipeline_ft.py")


def test_a_lost_stage_ends_the_job_naming_it():
    proc = mpitools.run_mpi(2, [sys.executable, SCRIPT], mpi_args=launch.ft_mpi_args(),
                            timeout=180)
    out = proc.stdout + proc.stderr
    assert "PIPELINE-FINISHED" not in out, out[-3000:]
    assert "PIPELINE-FAILURE matex.parallel: rank(s) 1 of this pipeline failed" in out, \
        out[-3000:]


def test_a_lost_tensor_parallel_rank_ends_the_job_naming_it(tmp_path):
    """Without a pipeline too: the grid vetoes MaTEx's shrink-and-continue recovery."""
    import os

    script = str(mpitools.ROOT / "tests" / "scripts" / "tensor_parallel_ft.py")
    proc = mpitools.run_mpi(2, [sys.executable, script], mpi_args=launch.ft_mpi_args(),
                            timeout=180, env=dict(os.environ,
                                                  MATEX_FLIGHT_DIR=str(tmp_path / "flight")))
    out = proc.stdout + proc.stderr
    assert "TP-FINISHED" not in out, out[-3000:]
    assert "TP-FAILURE matex.parallel: rank(s) 1 of this 1 x 1 x 2 grid failed" in out, \
        out[-3000:]
