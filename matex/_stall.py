"""The watchdog thread: SIGUSR1 dumps, stall inspection, stall abort.

One daemon thread per rank wakes every second or so (more often for short
``MATEX_STALL_WARNING_S``) and, without MPI:

* dumps the flight recorder when SIGUSR1 arrived (the core's signal handler
  only sets a flag: the dump happens here, even while the main thread is
  blocked in MPI or in compute);
* answers stall requests: when another rank's request file
  (``<flight dir>/stall-request.json``) is newer than the last one answered,
  it dumps this rank's recorder, which holds its sequence number and the
  Python stack of every thread;
* inspects its own collective: when one has waited longer than
  ``MATEX_STALL_WARNING_S``, it posts a request, waits briefly for the other
  members' dumps and prints one line naming the collective and its
  communicator, the members that have not arrived (their count of
  collectives on that communicator is lower: each communicator has its own
  order) and what each is doing. After
  ``MATEX_STALL_ABORT_S`` it ends the job (``MPI_Abort``) with that report.

Exchanging through files keeps this working whatever a rank is blocked in; on
several hosts the flight directory must be on a shared file system for other
ranks' states to be seen (the line then says "no answer" otherwise).
"""

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from matex import _atomic, _config, _state
from matex.flight import _recorder

log = logging.getLogger("matex")
REQUEST = "stall-request.json"

_now = _state.namespace("stall", "process", started=None)   # the watchdog, once started


def _early_sigusr1(signum, frame):
    """SIGUSR1 before the core is loaded: dump the Python stacks (no collectives yet)."""
    try:
        path = _recorder.dump("SIGUSR1")
        sys.stderr.write("matex: rank %d: flight recorder dumped to %s\n"
                         % (_config.launched_rank(), path))
    except Exception as exc:   # noqa: BLE001 - a dump that fails must not end the rank
        sys.stderr.write("matex: SIGUSR1: flight dump failed: %s\n" % exc)


def install_early_signal_handler() -> None:
    """From ``import matex`` on, SIGUSR1 dumps this rank instead of killing it.

    The core's own handler (which works while the main thread is blocked in
    MPI or compute) replaces this one when the core loads (``start``); before
    that, this Python handler dumps the Python stacks. Only from the main
    thread, and only where SIGUSR1 still has its default action (a handler the
    script installed stays).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
            signal.signal(signal.SIGUSR1, _early_sigusr1)
    except (ValueError, OSError, AttributeError):
        pass   # no SIGUSR1 (Windows) or signals unavailable here


def _hand_over_signal(core) -> None:
    """Install the core's SIGUSR1 handler in place of ``_early_sigusr1``."""
    if signal.getsignal(signal.SIGUSR1) is _early_sigusr1:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        else:
            # signal.signal works only on the main thread; the core loads on
            # whichever thread runs the first collective (TensorFlow's). The
            # C library's signal() resets the disposition for the process;
            # the core installs its handler right after.
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc.signal(int(signal.SIGUSR1), 0)   # SIG_DFL
    core.install_flight_signal(int(signal.SIGUSR1))


def start(core) -> None:
    """Start the recorder and the watchdog thread for this process (idempotent)."""
    if _now.started is not None:
        return
    import atexit

    core.set_flight_capacity(_config.flight_entries())
    _hand_over_signal(core)
    _now.started = Watchdog(core, Path(_config.flight_dir()), _config.stall_warning_s(),
                            _config.stall_abort_s())
    _now.started.start()
    atexit.register(_recorder.dump_at_exit)


class Watchdog(threading.Thread):
    """See the module docstring."""

    def __init__(self, core, directory: Path, warning: float, abort):
        super().__init__(name="matex-watchdog", daemon=True)
        self.core, self.directory = core, directory
        self.warning, self.abort = warning, abort
        shortest = min(x for x in (warning, abort, 4.0) if x)
        self.interval = max(0.05, min(1.0, shortest / 4))
        self.rank = _config.launched_rank()
        self.size = _config.launched_size() or 1
        self.answered = time.time()   # requests older than our start are not ours
        self.reported = None          # (communicator, number) of the last stall reported

    def run(self):
        while True:
            time.sleep(self.interval)
            try:
                self.tick()
            except Exception as exc:   # noqa: BLE001 - the watchdog must outlive a bad tick
                log.warning("matex: watchdog: %s", exc)

    def tick(self):
        if self.core.take_flight_signal():
            path = _recorder.dump("SIGUSR1")
            sys.stderr.write("matex: rank %d: flight recorder dumped to %s\n" % (self.rank, path))
        self.answer()
        if not self.core.flight_pending_since() or not (self.warning or self.abort):
            return   # nothing waits (one atomic read)
        # the collective waiting longest, on its communicator; none: a point-to-point wait
        waiting = [c for c in self.core.flight_comms() if c["pending_since"] and c["current"]]
        comm = min(waiting, key=lambda c: c["pending_since"]) if waiting else None
        since = comm["pending_since"] if comm else self.core.flight_pending_since()
        if not since:
            return
        waited = time.time() - since
        seq = comm["pending_seq"] if comm else self.core.flight_sequence()
        key = (comm["comm"] if comm else None, seq)
        if self.abort and waited >= self.abort:
            line = self.inspect(comm, seq, waited, "stall abort")
            sys.stderr.write(line + "\n")
            sys.stderr.write("matex: rank %d: ending the job: collective #%d waited %.1f s "
                             "(MATEX_STALL_ABORT_S=%g); flight dumps in %s\n"
                             % (self.rank, seq, waited, self.abort, self.directory))
            sys.stderr.flush()
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(3)
        elif self.warning and waited >= self.warning and self.reported != key:
            self.reported = key
            sys.stderr.write(self.inspect(comm, seq, waited, "stall") + "\n")
            sys.stderr.flush()

    def answer(self):
        """Dump this rank's state when another rank posted a newer stall request."""
        try:
            with open(self.directory / REQUEST) as f:
                request = json.load(f)
        except (OSError, ValueError):
            return
        if request.get("time", 0) > self.answered and request.get("job") == _config.job_id():
            self.answered = request["time"]
            _recorder.dump("stall request from rank %s at collective #%s"
                           % (request.get("rank"), request.get("seq")), self.directory)

    def inspect(self, comm, seq: int, waited: float, reason: str) -> str:
        """Ask the other members of ``comm`` for their state; return the one-line report.

        ``comm``: the communicator (``flight_comms()`` record) whose collective
        #``seq`` waits, or None for a point-to-point transfer (numbered in this
        process's order: peers' counts are not compared). Only that
        communicator's members are asked about, and only their counts on it
        compare: each communicator has its own order of collectives.
        """
        from matex.flight._analysis import comm_label, comms_of

        posted = time.time()
        self.directory.mkdir(parents=True, exist_ok=True)
        _atomic.write(self.directory / REQUEST,
                      json.dumps({"time": posted, "rank": self.rank, "seq": seq,
                                  "comm": comm["comm"] if comm else None,
                                  "job": _config.job_id()}))
        self.answered = posted
        _recorder.dump(reason, self.directory)
        peers = [r for r in (comm["members"] if comm else []) if r != self.rank]
        others = {}
        deadline = posted + 3 * self.interval + 1.0
        while peers:
            for r in peers:
                if r not in others:
                    state = _read(self.directory / ("rank%d.json" % r))
                    if (state and state.get("time", 0) >= posted
                            and state.get("job") == _config.job_id()):
                        others[r] = state
            if len(others) == len(peers) or time.time() > deadline:
                break
            time.sleep(self.interval / 2)
        if comm is None:
            mine = next((e for e in self.core.flight_entries() if e["seq"] == seq), None)
            what = "point-to-point transfer #%d" % seq
        else:
            mine = next((e for e in self.core.flight_entries()
                         if e.get("comm") == comm["comm"] and e.get("comm_seq") == seq), None)
            what = "collective #%d" % seq
        if mine:
            what += " " + _recorder.describe(mine)
            if mine["site"]:
                what += " (from %s)" % mine["site"]
        if comm is not None:
            what += " on " + comm_label(comm["members"], self.size)
        late = []
        for r in peers:
            state = others.get(r)
            if state is None:
                late.append("rank %d [no answer: not responding, or dead]" % r)
                continue
            main = next(iter(state["stacks"].values()), {}).get("where", "?")
            theirs = comms_of(state).get(comm["comm"])
            if theirs is None:
                late.append("rank %d [has not made this communicator; now at %s]" % (r, main))
            elif theirs["seq"] < seq:
                late.append("rank %d [last collective #%d; now at %s]" % (r, theirs["seq"], main))
        if comm is None:
            arrived = "not compared (a point-to-point transfer: see the peer's dump)"
        else:
            arrived = "; ".join(late) or "none (all ranks are in it)"
        return ("matex: stall: rank %d has waited %.1f s in %s; ranks not arrived: %s; "
                "stacks and flight records in %s"
                % (self.rank, waited, what, arrived, self.directory))


def _read(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
