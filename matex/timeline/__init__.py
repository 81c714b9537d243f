"""The timeline: one Chrome-trace/Perfetto JSON per rank of what each collective and step did.

Start it with ``matexrun --timeline DIR`` (or ``MATEX_TIMELINE=DIR``, or
``matex.timeline.start(DIR)`` on every rank); ``--timeline-steps 100-120``
(``MATEX_TIMELINE_STEPS``) records only those training steps. Each rank
writes ``DIR/timeline-rank<N>.json`` locally while it trains (a background
thread drains the flight recorder's ring: nothing accumulates in memory),
on clocks aligned with rank 0's at start. ``python -m matex.timeline merge
DIR`` writes ``DIR/merged.json``, one process row per rank, for
chrome://tracing or https://ui.perfetto.dev.

What it shows per collective: the wait for the slowest rank, the agreement
check, the transfer and the bytes (plus the tensors of a fused bucket); per
training step (``fit``'s, or a custom loop's marked with ``step``):
forward+backward, allreduce and apply; per batch the readers
make: shuffle, read and decode (``span``). When no timeline is asked for,
nothing of this runs.
"""

import atexit
import contextlib
import os
import threading
import time

from matex import _config, _state
from matex.timeline._writer import TimelineError, Writer, check_writable, filename

__all__ = ["start", "stop", "active", "step", "span", "TimelineError", "check_writable", "filename"]

# writer: the running Writer or None; atexit: stop() is registered at exit; next_step: the
# number step() gives when none is passed; autostarted: autostart() has run
_now = _state.namespace("timeline", writer=None, atexit=False, next_step=0, autostarted=False)
_lock = threading.Lock()


def parse_steps(steps: str | int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"100-120"``, ``(100, 120)``, ``7`` or None -> ``(first, last)`` or None."""
    if steps is None:
        return None
    if isinstance(steps, int):
        steps = (steps, steps)
    if isinstance(steps, str):
        return _config.parse_step_range(steps, "timeline steps")
    first, last = steps
    return _config.parse_step_range("%d-%d" % (first, last), "timeline steps")


def start(directory: str | os.PathLike,
          steps: str | int | tuple[int, int] | None = None) -> None:
    """Start writing this rank's timeline to ``directory`` (collective: call on every rank).

    ``steps``: record only these training steps (``"100-120"`` or a pair,
    both included); None records all. Raises ``TimelineError`` at once, on
    every rank, when a rank cannot write to ``directory`` or ``steps`` is
    malformed.
    """
    from matex import _runtime

    try:
        steps = parse_steps(steps)
    except ValueError as exc:
        raise TimelineError(str(exc)) from None
    core = _runtime._core()
    control = _runtime.control()
    with _lock:
        if _now.writer is not None:
            raise TimelineError("matex.timeline: already recording to %s"
                                % _now.writer.path.parent)
        error, writer = None, None
        try:
            directory = check_writable(directory)
            writer = Writer(core, directory, _config.launched_rank(),
                            _config.launched_size() or control.Get_size(), steps)
        except (TimelineError, OSError) as exc:
            error = str(exc)
        errors = control.allgather(error)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            if writer is not None:
                writer.file.close()
            raise TimelineError("; ".join("rank %d: %s" % (r, e) for r, e in bad))
        assert writer is not None   # no rank failed, this one included
        if core.flight_capacity() == 0:
            core.set_flight_capacity(1024)   # the timeline reads the flight recorder's ring
        from matex.timeline._clock import align

        offset, origin, round_trip = align(control)
        writer.begin(offset, origin, round_trip, _config.job_id())
        writer.last_seq = core.flight_sequence()
        writer.start()
        _now.writer = writer
        if not _now.atexit:
            atexit.register(stop)
            _now.atexit = True


def stop() -> None:
    """Finish this rank's timeline file (not collective; also runs at exit)."""
    with _lock:
        writer, _now.writer = _now.writer, None
    if writer is not None:
        writer.stop()


def active() -> bool:
    """Whether this rank is writing a timeline now."""
    return _now.writer is not None


def requested() -> bool:
    """Whether a timeline is written now or ``MATEX_TIMELINE`` asks for one (started
    later, at MaTEx's start): what decides whether to instrument for it."""
    return active() or bool(_config.timeline_dir())


def writer() -> Writer | None:
    """The running writer, or None (used by the timeline callback)."""
    return _now.writer


_OFF = contextlib.nullcontext()


class _Span:
    __slots__ = ("writer", "tid", "name", "args", "t0")

    def __init__(self, writer, tid, name, args):
        self.writer, self.tid, self.name, self.args = writer, tid, name, args

    def __enter__(self):
        self.t0 = time.time()
        return self

    def __exit__(self, *exc):
        self.writer.record(self.tid, self.name, self.t0, time.time(), self.args or None,
                           cat="reader")
        return False


class _Step:
    __slots__ = ("writer", "number")

    def __init__(self, writer, number):
        self.writer, self.number = writer, number

    def __enter__(self):
        self.writer.step_begin(self.number)
        return self

    def __exit__(self, *exc):
        self.writer.step_end(self.number)
        return False


def step(number: int | None = None) -> contextlib.AbstractContextManager:
    """``with matex.timeline.step(i): train_step(...)`` marks a custom loop's training step.

    What ``fit`` gets from its callback: the step's span with its phases
    (forward+backward, allreduce, apply), and ``--timeline-steps`` sampling
    by ``number`` (default: one more than the last step marked this way,
    from 0). A no-op context when no timeline is being written.
    """
    if number is None:
        number = _now.next_step
    _now.next_step = int(number) + 1
    w = _now.writer
    if w is None:
        return _OFF
    return _Step(w, int(number))


def span(name: str, **args: object) -> contextlib.AbstractContextManager:
    """``with matex.timeline.span("read", rows=256): ...`` records that block on the reader row.

    Any thread may use it (the readers' worker threads do). When no timeline
    is being written it returns a shared no-op context: one attribute read.
    """
    w = _now.writer
    if w is None:
        return _OFF
    from matex.timeline._writer import READER_TID

    return _Span(w, READER_TID, name, args)


def autostart() -> None:
    """Start the timeline ``MATEX_TIMELINE`` asks for (once; at MaTEx's start, on every rank)."""
    if _now.autostarted:
        return
    _now.autostarted = True
    directory = _config.timeline_dir()
    if directory:
        try:
            steps = _config.timeline_steps()
        except ValueError as exc:
            raise TimelineError(str(exc)) from None
        start(directory, steps)
