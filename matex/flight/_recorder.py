"""Writing flight-recorder dumps: this rank's recent collectives and Python stacks.

The ring buffer itself lives in the C++ core (``flight_entries``); this module
turns it into ``<dir>/rank<N>.json`` (N: the rank in ``MPI_COMM_WORLD``, stable
across shrinks). Dumping needs no MPI, so it works from any thread while the
main thread is blocked in a collective or in compute.
"""

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from matex import _atomic, _config, _state

FORMAT = "matex-flight/2"   # /2: entries name their communicator (comm, comm_seq)
KINDS = {1: "allreduce", 2: "fused allreduce", 3: "broadcast", 4: "allgather",
         5: "send", 6: "receive", 7: "send-receive", 8: "sparse allreduce",
         9: "non-blocking allreduce", 10: "alltoall",
         11: "reducescatter"}   # internal::Kind in tf_ops/core/internal.h
REDUCE_OPS = ("sum", "average", "min", "max", "product")
STATES = ("pending", "ok", "mismatch", "MPI error", "invalid")

_now = _state.namespace("flight.recorder", "process",
                       last_dump=0.0)   # time.time() of this process's last dump


def describe(entry: dict) -> str:
    """One collective for people: ``allreduce(sum) of float32[4,4]``."""
    kind = KINDS.get(entry.get("kind"), "collective")
    param = entry.get("param", 0)
    if entry.get("kind") in (1, 2, 11):
        head = "%s(%s)" % (kind, REDUCE_OPS[param] if 0 <= param < len(REDUCE_OPS) else param)
    elif entry.get("kind") == 3:
        head = "broadcast(root=%d)" % param
    else:
        head = kind
    if entry.get("num_tensors", 1) == 1:
        what = "%s[%s]" % (entry.get("dtype"), ",".join(map(str, entry.get("shape", []))))
    else:
        what = "%d %s tensors (%d bytes)" % (entry["num_tensors"], entry.get("dtype"),
                                             entry.get("bytes", 0))
    return "%s of %s" % (head, what)


def _entry(raw: dict) -> dict:
    entry = dict(raw)
    entry["op"] = describe(raw)
    entry["state"] = STATES[raw["state"]] if 0 <= raw["state"] < len(STATES) else raw["state"]
    return entry


def _library(filename: str) -> bool:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return ("site-packages" in filename or "dist-packages" in filename
            or filename.startswith(here) or filename.startswith("<"))


def where(frame) -> str:
    """The innermost frame of ``frame``'s stack that is the script's own code, as text."""
    chosen = frame
    f = frame
    while f is not None:
        if not _library(f.f_code.co_filename):
            chosen = f
            break
        f = f.f_back
    summary = traceback.extract_stack(chosen, limit=1)[-1]
    text = "%s:%d in %s" % (summary.filename, summary.lineno, summary.name)
    if summary.line:
        text += ": " + summary.line.strip()
    return text


def stacks() -> dict:
    """Every thread's current Python stack (the calling thread's excluded), main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    out = {}
    frames = sys._current_frames()
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == me and ident != main:
            continue   # the dumping thread itself (the watchdog) says nothing
        out["%s (%d)" % (names.get(ident, "thread"), ident)] = {
            "where": where(frames[ident]),
            "stack": traceback.format_stack(frames[ident]),
        }
    return out


def dump(reason: str = "requested", directory: str | os.PathLike | None = None) -> Path:
    """Write this rank's dump to ``directory`` (default ``MATEX_FLIGHT_DIR``); return its path.

    Holds the last collectives the core recorded (oldest first; each names its
    communicator and its number there), the number of the last one this
    process started, the start of the one in progress (0 when none), every
    communicator's own count and waiting collective, and every thread's
    Python stack.
    """
    from matex import _native

    directory = Path(directory or _config.flight_dir())
    directory.mkdir(parents=True, exist_ok=True)
    core = _native.loaded()
    rank = _config.launched_rank()
    record = {
        "format": FORMAT,
        "job": _config.job_id(),
        "world_rank": rank,
        "world_size": _config.launched_size() or 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "reason": reason,
        "time": time.time(),
        "sequence": core.flight_sequence() if core else 0,   # this process's, all communicators
        # each communicator's own count and waiting collective: what compares across ranks
        "comms": core.flight_comms() if core else [],
        "pending_since": core.flight_pending_since() if core else 0.0,
        "capacity": core.flight_capacity() if core else 0,
        "entries": [_entry(e) for e in core.flight_entries()] if core else [],
        "stacks": stacks(),
    }
    path = directory / ("rank%d.json" % rank)
    _atomic.write(path, json.dumps(record, indent=1))
    _now.last_dump = record["time"]
    return path


def failed_since_last_dump() -> bool:
    """Whether a recorded collective failed after this process's last dump."""
    from matex import _native

    core = _native.loaded()
    if core is None:
        return False
    return any(e["state"] in (2, 3) and e["end"] > _now.last_dump for e in core.flight_entries())


def dump_at_exit():
    """atexit hook: dump once more when a collective failed since the last dump."""
    try:
        if failed_since_last_dump():
            path = dump("exit after a failed collective")
            sys.stderr.write("matex: flight recorder dumped to %s\n" % path)
    except Exception:   # noqa: BLE001 - never turn an exit into a second failure
        pass
