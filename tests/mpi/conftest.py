"""Per-rank pytest set-up for suites launched under mpiexec.

Each rank writes its own JUnit report (MATEX_TEST_REPORT_DIR/rank<N>.xml);
ranks other than 0 send their terminal output to rank<N>.log. A test that
runs longer than MATEX_TEST_TIMEOUT seconds (default 180) dumps every thread's
stack and exits, which ends the whole MPI job instead of hanging it. The dump
goes to rank<N>-timeout.log beside the report (pytest captures stderr, and a
rank that exits mid-test never prints what it captured); ``mpitools.run_suite``
shows every rank*.log when a suite fails.
"""

import faulthandler
import os
import sys

import pytest
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
TIMEOUT = float(os.environ.get("MATEX_TEST_TIMEOUT", "180"))
_dump = {"file": None}   # where a timed-out test's stacks go


def pytest_configure(config):
    report_dir = os.environ.get("MATEX_TEST_REPORT_DIR")
    if report_dir:
        config.option.xmlpath = os.path.join(report_dir, "rank%d.xml" % RANK)
        _dump["file"] = open(os.path.join(report_dir, "rank%d-timeout.log" % RANK), "w")
        if RANK != 0:
            log = open(os.path.join(report_dir, "rank%d.log" % RANK), "w")
            os.dup2(log.fileno(), 1)
            sys.stdout = log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    faulthandler.dump_traceback_later(TIMEOUT, exit=True, file=_dump["file"] or sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _explicit_layers_end_with_the_test():
    """A test that used Horovod's layer leaves MaTEx's transparent Keras patches acting for
    the next one (they stand down once a script uses an explicit layer)."""
    yield
    from matex import _transparent

    _transparent.reset_explicit_layers()
