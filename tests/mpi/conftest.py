"""Per-rank pytest set-up for suites launched under mpiexec.

Each rank writes its own JUnit report (MATEX_TEST_REPORT_DIR/rank<N>.xml);
ranks other than 0 send their terminal output to rank<N>.log. A test that
runs longer than MATEX_TEST_TIMEOUT seconds (default 180) dumps every thread's
stack and exits, which ends the whole MPI job instead of hanging it.
"""

import faulthandler
import os
import sys

import pytest
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
TIMEOUT = float(os.environ.get("MATEX_TEST_TIMEOUT", "180"))


def pytest_configure(config):
    report_dir = os.environ.get("MATEX_TEST_REPORT_DIR")
    if report_dir:
        config.option.xmlpath = os.path.join(report_dir, "rank%d.xml" % RANK)
        if RANK != 0:
            log = open(os.path.join(report_dir, "rank%d.log" % RANK), "w")
            os.dup2(log.fileno(), 1)
            sys.stdout = log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    faulthandler.dump_traceback_later(TIMEOUT, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
