"""Under ULFM a pipelined run does not recover: a lost stage ends the job with its name."""

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
