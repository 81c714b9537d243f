"""The status directory: how a failing rank tells ``matexrun --ft`` that it failed.

Under ULFM ``mpiexec`` exits 0 even when every rank died, so the launcher
cannot tell from its exit status. It names a directory to every rank
(``MATEX_STATUS_DIR``); a rank that fails leaves ``failed.<world rank>``
there before it dies (``report_failure``, called by the resilience layer),
and the launcher counts the files (``failed_ranks``). Both sides import this
module; it imports neither MPI nor TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from matex import _config

_FAILED = "failed."      # failed.<world rank>: that rank failed


def report_failure(rank: int, text: str, env: Mapping[str, str] | None = None) -> str | None:
    """Record in ``matexrun --ft``'s status directory that world rank ``rank`` failed.

    Writes ``failed.<rank>`` holding the last line of ``text`` (a traceback's:
    the exception), under a temporary name first, so that the launcher never
    reads half a file. Returns its path; None when not run by ``matexrun --ft``.
    """
    directory = _config.status_dir(env)
    if not directory:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    path = os.path.join(directory, "%s%d" % (_FAILED, rank))
    partial = os.path.join(directory, ".%s%d.%d" % (_FAILED, rank, os.getpid()))
    with open(partial, "w") as out:
        out.write((lines[-1] if lines else "failed") + "\n")
    os.replace(partial, path)
    return path


def failed_ranks(directory: str | os.PathLike) -> dict[int, str]:
    """World rank -> last line of its traceback, for each rank that reported failing."""
    failed = {}
    for name in os.listdir(directory):
        rank = name[len(_FAILED):]
        if name.startswith(_FAILED) and rank.isdigit():
            with open(os.path.join(directory, name), errors="replace") as report:
                failed[int(rank)] = report.read().strip()
    return failed
