"""Supervising the job: rank failures under ``--ft``, restarts under ``--restart``."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence


def run_fault_tolerant(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run ``cmd`` under ULFM, passing its stderr through; exit 1 if every rank failed.

    Under ULFM ``mpiexec`` exits 0 even when every rank died; each failing rank
    says so (``_resilience.FAILED_LINE``), and those lines are counted here.
    """
    from matex import _resilience

    pattern = re.compile(_resilience.FAILED_LINE.replace("%d", r"(\d+)").split(";")[0])
    failed, size = set(), 0
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    for line in proc.stderr:
        sys.stderr.buffer.write(line)
        sys.stderr.flush()
        for rank, total in pattern.findall(line.decode(errors="replace")):
            failed.add(int(rank))
            size = int(total)
    code = proc.wait()
    if code == 0 and size and len(failed) >= size:
        print("matexrun: every rank failed (%d of %d); the job failed" % (len(failed), size),
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
