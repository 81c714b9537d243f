"""The status directory: how the ranks tell ``matexrun --ft`` how they ended.

Under ULFM ``mpiexec`` exits 0 even when every rank died, and it waits for
a rank that hangs even after the others excluded it, so the launcher cannot
rely on it. It names a directory to every rank (``MATEX_STATUS_DIR``) where,
under ``python -m matex``,

* each rank leaves ``started.<world rank>`` (host and pid) when it starts
  (``report_start``): lets the launcher end a rank the survivors excluded;
* each rank leaves ``ready.<world rank>`` once MPI has started
  (``report_ready``): from then on ULFM recovers from a lost rank, while a
  rank lost before that leaves the others waiting inside ``MPI_Init`` (the
  launcher then relaunches the job, see ``matex.launcher.supervise``);
* a rank that fails leaves ``failed.<world rank>`` before it dies
  (``report_failure``, called by the resilience layer);
* a rank whose script returned leaves ``exit.<world rank>`` with its exit
  status and the world ranks it had lost (``report_exit``).

A rank killed by a signal leaves no ``failed``/``exit`` file. The launcher
reads the files (``read_status``); writes go through a temporary name, so it
never reads half a file. Both sides import this module; it imports neither
MPI nor TensorFlow.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from matex import _atomic, _config

_FAILED = "failed."      # failed.<world rank>: that rank failed
_STARTED = "started."    # started.<world rank>: {"host", "pid"}
_EXIT = "exit."          # exit.<world rank>: {"code", "lost"}
_READY = "ready."        # ready.<world rank>: {} once MPI has started there


def _write(directory: str, name: str, text: str) -> str:
    return _atomic.write(os.path.join(directory, name), text)


def report_failure(rank: int, text: str, env: Mapping[str, str] | None = None) -> str | None:
    """Record in ``matexrun --ft``'s status directory that world rank ``rank`` failed.

    Writes ``failed.<rank>`` holding the last line of ``text`` (a traceback's:
    the exception). Returns its path; None when not run by ``matexrun --ft``.
    """
    directory = _config.status_dir(env)
    if not directory:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    return _write(directory, "%s%d" % (_FAILED, rank), (lines[-1] if lines else "failed") + "\n")


def report_start(rank: int, env: Mapping[str, str] | None = None) -> str | None:
    """Record that world rank ``rank`` runs here (host name, pid); None when not under --ft."""
    directory = _config.status_dir(env)
    if not directory:
        return None
    return _write(directory, "%s%d" % (_STARTED, rank),
                  json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def report_ready(rank: int, env: Mapping[str, str] | None = None) -> str | None:
    """Record that MPI has started on world rank ``rank``; None when not under --ft."""
    directory = _config.status_dir(env)
    if not directory:
        return None
    return _write(directory, "%s%d" % (_READY, rank), "{}")


def report_exit(rank: int, code: int, lost: Iterable[int] = (),
                env: Mapping[str, str] | None = None) -> str | None:
    """Record that world rank ``rank``'s script ended with exit status ``code``, having
    excluded the world ranks ``lost``; None when not run by ``matexrun --ft``."""
    directory = _config.status_dir(env)
    if not directory:
        return None
    return _write(directory, "%s%d" % (_EXIT, rank),
                  json.dumps({"code": int(code), "lost": sorted(int(r) for r in lost)}))


class Status(NamedTuple):
    """What the ranks reported: world rank -> traceback's last line / exit status / where."""

    failed: dict
    exited: dict
    lost: set
    started: dict
    ready: frozenset = frozenset()


def _read(path):
    try:
        with open(path, errors="replace") as report:
            return report.read()
    except OSError:
        return None


def read_status(directory: str | os.PathLike) -> Status:
    """The reports in ``directory``: failed ranks (last line of their traceback), exited ranks
    (exit status), the ranks some exited rank had lost, started ranks ((host, pid)), the
    ranks where MPI has started."""
    failed, exited, lost, started, ready = {}, {}, set(), {}, set()
    for name in os.listdir(directory):
        prefix, _, rank = name.rpartition(".")
        if not rank.isdigit() or prefix + "." not in (_FAILED, _STARTED, _EXIT, _READY):
            continue
        if prefix + "." == _READY:
            ready.add(int(rank))
            continue
        text = _read(os.path.join(directory, name))
        if text is None:
            continue
        if prefix + "." == _FAILED:
            failed[int(rank)] = text.strip()
            continue
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if prefix + "." == _EXIT:
            exited[int(rank)] = int(record["code"])
            lost.update(int(r) for r in record.get("lost", ()))
        else:
            started[int(rank)] = (record["host"], int(record["pid"]))
    return Status(failed, exited, lost, started, frozenset(ready))


def failed_ranks(directory: str | os.PathLike) -> dict[int, str]:
    """World rank -> last line of its traceback, for each rank that reported failing."""
    return read_status(directory).failed
