"""Supervising the job: rank failures under ``--ft``, restarts under ``--restart``.

Under ULFM, ``mpiexec`` exits 0 even when every rank died. So that ``matexrun
--ft`` can tell, a rank that fails leaves a file in a status directory before
it dies (``report_failure``, called by ``_resilience.die_like_a_crash``): the
launcher creates the directory, names it to every rank in
``MATEX_STATUS_DIR``, counts the files once ``mpiexec`` has ended, and removes
it. Nothing depends on what the ranks print, or on where their stderr goes.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence

from matex._config import STATUS_DIR_VAR
from matex._status import failed_ranks, report_failure  # noqa: F401 - re-exported


@contextlib.contextmanager
def status_directory(parent: str | None = None) -> Iterator[str]:
    """A new, empty status directory in ``parent`` (default: the temporary directory).

    Removed, with whatever the ranks wrote, when the block ends.
    """
    directory = tempfile.mkdtemp(prefix="matexrun-status-", dir=parent)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_fault_tolerant(cmd: Sequence[str], env: Mapping[str, str], nranks: int,
                       status_parent: str | None = None) -> int:
    """Run ``cmd`` (an mpiexec under ULFM) on ``nranks`` ranks; 1 if every rank failed.

    The ranks find their status directory, created in ``status_parent``, in
    ``MATEX_STATUS_DIR`` (``cmd`` must forward it to other hosts, and there
    ``status_parent`` must be a directory they share). Otherwise mpiexec's
    exit status.
    """
    with status_directory(status_parent) as directory:
        code = subprocess.call(list(cmd), env={**env, STATUS_DIR_VAR: directory})
        failed = failed_ranks(directory)
    if code == 0 and len(failed) >= nranks:
        print("matexrun: every rank failed (%d of %d); the job failed" % (len(failed), nranks),
              file=sys.stderr, flush=True)
        return 1
    return code


def run_with_restarts(cmd: Sequence[str], nranks: int, env: dict[str, str],
                      restarts: int) -> int:
    """Run ``cmd``; after a failure rerun it up to ``restarts`` times, one rank fewer each."""
    code = subprocess.call(cmd, env=env)
    for attempt in range(restarts):
        if code == 0 or nranks == 1:
            break
        nranks -= 1
        cmd = list(cmd)
        cmd[cmd.index("-n") + 1] = str(nranks)
        env["MATEX_INJECT_FAULT"] = ""   # injected faults fire in the first run only
        print("matexrun: the job failed (exit %d); restarting from the last checkpoint in %s "
              "on %d rank(s) (restart %d of %d)" % (code, env["MATEX_CHECKPOINT_DIR"], nranks,
                                                   attempt + 1, restarts),
              file=sys.stderr, flush=True)
        code = subprocess.call(cmd, env=env)
    return code
