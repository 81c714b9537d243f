"""The timeline's writer: a background thread turning the flight recorder into trace events.

The C++ core already stamps every collective with its start, the moment all
ranks had arrived (the agreement check completed) and its end; this thread
reads the ring every ``MAX_WAIT_S`` seconds (sooner when a quarter of it is
new), takes the collectives it has not
written yet (by sequence number) and appends them to ``timeline-rank<N>.json``
as Chrome-trace events, one JSON object per line: nothing is held in memory
beyond one poll. The training thread only hands over step boundaries (four
numbers per step, see ``step_begin``/``step_end``).

Events (``pid`` = rank, ``ts``/``dur`` in microseconds on rank 0's clock,
counted from rank 0's time at start):

* tid 1 "collectives": one span per collective (name: what it reduced; args:
  seq, bytes, tensors of a fused bucket, call site, outcome), holding two
  spans: "arrive: check + wait for the slowest rank" (start to all arrived)
  and "transfer" (all arrived to end); a counter "bytes" per collective.
  ``python -m matex.timeline merge`` splits the first span into the wait for
  the slowest rank and the agreement check, since only all ranks' starts
  tell them apart.
* tid 2 "steps": one span per training step, holding "forward+backward"
  (step start to its first gradient collective), "allreduce" (first
  gradient collective's start to the last one's end; backprop of earlier
  layers overlaps it) and "apply" (the rest: update, metrics).
* tid 3 "reader": what ``matex.readers`` spent producing batches, from the
  thread that did it: "shuffle" (an epoch's permutation and plan), "read"
  (rows from the file: a gather from the mapped file, or a read of the
  rows' chunks) and "decode" (rows to batch arrays: parsing, stacking).
  Readers prefetch, so these overlap the steps they feed. With sampling,
  only reader work done while the sampled steps run is kept.
"""

import json
import os
import threading
import time
from pathlib import Path

FORMAT = "matex-timeline/1"
POLL_S = 0.25      # how often the writer looks at the sequence number (one atomic read)
MAX_WAIT_S = 2.0   # longest wait before what has finished is written
COLLECTIVES_TID, STEPS_TID, READER_TID = 1, 2, 3
GRADIENT_KINDS = (1, 2)   # allreduce, fused allreduce


_json = json.JSONEncoder(separators=(",", ":")).encode


class TimelineError(ValueError):
    """A timeline that cannot be written or read (bad directory, bad step range, no files)."""


def filename(rank: int) -> str:
    return "timeline-rank%d.json" % rank


class Writer(threading.Thread):
    """See the module docstring. Opening the file happens in the constructor (fail early)."""

    def __init__(self, core, directory: Path, rank: int, size: int, steps=None):
        super().__init__(name="matex-timeline", daemon=True)
        self.core, self.rank, self.size, self.steps = core, rank, size, steps
        self.path = Path(directory) / filename(rank)
        self.file = open(self.path, "w", buffering=1 << 16)   # OSError: caller explains
        self.offset = self.origin = self.round_trip = 0.0
        self.last_seq = core.flight_sequence()   # collectives before the start are not ours
        self.windows = []       # (step, t_begin, t_end, seq_begin, seq_end), closed steps
        self.open_step = None   # (step, t_begin, seq_begin) of the step running, when recorded
        self.finished = False   # the sampled steps are over
        self.recent = {}        # seq -> (start, end, kind) of written collectives, for steps
        self.dropped = 0        # collectives the ring overwrote before this thread read them
        self.written = 0
        self.cpu_s = 0.0        # CPU time this writer spent draining (its cost to training)
        self.started = steps is None   # the sampled steps have begun
        self.spans = []         # (tid, name, t0, t1, args, cat) from other threads (reader work)
        self._halt = threading.Event()
        self._lock = threading.Lock()

    # ---- training thread -------------------------------------------------------

    def wants(self, step: int) -> bool:
        """Whether ``step`` is recorded (the sampled range, or all)."""
        return self.steps is None or self.steps[0] <= step <= self.steps[1]

    def step_begin(self, step: int) -> None:
        if self.wants(step):
            self.started = True
            self.open_step = (step, time.time(), self.core.flight_sequence())
        elif self.steps is not None and step > self.steps[1]:
            self.finished = True

    def step_end(self, step: int) -> None:
        opened = self.open_step
        if opened is not None and opened[0] == step:
            self.open_step = None
            with self._lock:
                self.windows.append(opened[:2] + (time.time(), opened[2],
                                                  self.core.flight_sequence()))

    def record(self, tid: int, name: str, t0: float, t1: float, args=None, cat="matex") -> None:
        """Keep a span some thread measured (any thread); written at the next drain."""
        if not self.started or self.finished:
            return   # outside the sampled steps
        with self._lock:
            self.spans.append((tid, name, t0, t1, args, cat))

    # ---- writer thread ------------------------------------------------------------

    def begin(self, offset: float, origin: float, round_trip: float, job: str) -> None:
        """Write the header: process and thread names, clock alignment."""
        self.offset, self.origin, self.round_trip = offset, origin, round_trip
        self.file.write("[\n")
        meta = {"format": FORMAT, "job": job, "world_rank": self.rank, "world_size": self.size,
                "clock_offset_s": offset, "origin_s": origin, "round_trip_s": round_trip,
                "steps": list(self.steps) if self.steps else None}
        for ev in ({"name": "process_name", "args": {"name": "rank %d" % self.rank}},
                   {"name": "process_sort_index", "args": {"sort_index": self.rank}},
                   {"name": "thread_name", "tid": COLLECTIVES_TID,
                    "args": {"name": "collectives"}},
                   {"name": "thread_name", "tid": STEPS_TID, "args": {"name": "steps"}},
                   {"name": "thread_name", "tid": READER_TID, "args": {"name": "reader"}},
                   {"name": "matex_timeline", "args": meta}):
            self._emit(dict({"ph": "M", "pid": self.rank, "tid": 0}, **ev))
        self.file.flush()

    def run(self):
        last = time.monotonic()
        while not self._halt.wait(POLL_S):
            # Reading the ring copies all of it: read it when a quarter of it is new, or
            # every MAX_WAIT_S, not at every wake-up.
            new = self.core.flight_sequence() - self.last_seq
            if new >= self.core.flight_capacity() // 4 or time.monotonic() - last >= MAX_WAIT_S:
                self.drain()
                last = time.monotonic()

    def stop(self) -> None:
        """Write what is left, close the JSON array and the file (idempotent)."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()
        if self.file.closed:
            return
        self.drain(final=True)
        self.file.write(json.dumps({"ph": "M", "pid": self.rank, "tid": 0,
                                    "name": "matex_timeline_end",
                                    "args": {"written": self.written,
                                             "dropped": self.dropped,
                                             "writer_cpu_s": round(self.cpu_s, 6)}},
                                   separators=(",", ":")) + "\n]\n")
        self.file.close()

    def _emit(self, ev: dict) -> None:
        self.file.write(json.dumps(ev, separators=(",", ":")) + ",\n")

    def _span(self, tid, name, t0, t1, args=None, cat="matex"):
        # formatted by hand: json.dumps of the whole event costs twice as much
        self.file.write('{"ph":"X","pid":%d,"tid":%d,"name":%s,"cat":"%s","ts":%.3f,'
                        '"dur":%.3f%s},\n'
                        % (self.rank, tid, _json(name), cat,
                           (t0 - self.offset - self.origin) * 1e6, max(t1 - t0, 0.0) * 1e6,
                           ',"args":' + _json(args) if args else ""))

    def drain(self, final: bool = False) -> None:
        """Write the collectives finished since the last drain, then the steps they complete."""
        if self.file.closed:
            return
        cpu = time.thread_time()
        try:
            self._drain(final)
        finally:
            self.cpu_s += time.thread_time() - cpu

    def _drain(self, final: bool) -> None:
        with self._lock:
            windows, self.windows = self.windows, []
            spans, self.spans = self.spans, []
            opened = self.open_step
        for tid, name, t0, t1, args, cat in spans:
            self._span(tid, name, t0, t1, args, cat=cat)
        sampling = self.steps is not None
        if sampling:
            horizon = max([w[4] for w in windows] + [opened[2] if opened else 0])
            if self.finished or final:
                horizon = float("inf")
        else:
            horizon = float("inf")
        keep = [(w[3], w[4]) for w in windows] + ([(opened[2], float("inf"))] if opened else [])
        if self.last_seq < horizon:
            from matex import _fusion

            for e in self.core.flight_entries():
                seq = e["seq"]
                if seq <= self.last_seq:
                    continue
                if e["state"] == 0 or seq > horizon:
                    break   # still running, or not yet known to be inside a sampled step
                if seq != self.last_seq + 1 and not sampling:
                    self.dropped += seq - self.last_seq - 1
                self.last_seq = seq
                if sampling and not any(lo < seq <= hi for lo, hi in keep):
                    continue
                self._collective(e, _bucket(_fusion.bucket_names, e["site"]))
        for w in windows:
            self._step(*w)
        if len(self.recent) > 4096:
            floor = self.last_seq - 2048
            self.recent = {s: v for s, v in self.recent.items() if s > floor}
        self.file.flush()

    def _collective(self, e: dict, tensors) -> None:
        from matex.flight._recorder import STATES, describe

        start, agreed, end = e["start"], e["agreed"] or e["end"], e["end"]
        args = {"seq": e["seq"], "comm": e["comm"], "comm_seq": e["comm_seq"],
                "bytes": e["bytes"], "dtype": e["dtype"],
                "shape": e["shape"], "num_tensors": e["num_tensors"],
                "comm_size": e["comm_size"], "site": e["site"],
                "state": STATES[e["state"]] if 0 <= e["state"] < len(STATES) else e["state"],
                "arrive_us": round((agreed - start) * 1e6, 3),
                "transfer_us": round((end - agreed) * 1e6, 3)}
        if tensors:
            args["tensors"] = tensors
        self._span(COLLECTIVES_TID, describe(e), start, end, args, cat="collective")
        self._span(COLLECTIVES_TID, "arrive: check + wait for the slowest rank", start, agreed,
                   {"seq": e["seq"], "comm": e["comm"], "comm_seq": e["comm_seq"]},
                   cat="arrive")
        self._span(COLLECTIVES_TID, "transfer", agreed, end,
                   {"seq": e["seq"], "bytes": e["bytes"]}, cat="transfer")
        self.file.write('{"ph":"C","pid":%d,"tid":%d,"name":"bytes","ts":%.3f,'
                        '"args":{"bytes":%d}},\n'
                        % (self.rank, COLLECTIVES_TID, (start - self.offset - self.origin) * 1e6,
                           e["bytes"]))
        self.written += 1
        self.recent[e["seq"]] = (start, end, e["kind"])

    def _step(self, step, t_begin, t_end, seq_begin, seq_end) -> None:
        grads = [self.recent[s] for s in range(seq_begin + 1, seq_end + 1)
                 if s in self.recent and self.recent[s][2] in GRADIENT_KINDS]
        args = {"step": step, "collectives": seq_end - seq_begin}
        self._span(STEPS_TID, "step %d" % step, t_begin, t_end, args, cat="step")
        if grads:
            first, last = min(g[0] for g in grads), max(g[1] for g in grads)
            self._span(STEPS_TID, "forward+backward", t_begin, first, {"step": step},
                       cat="phase")
            self._span(STEPS_TID, "allreduce", first, last, {"step": step}, cat="phase")
            self._span(STEPS_TID, "apply", last, t_end, {"step": step}, cat="phase")


def _bucket(names: dict, site: str):
    """The tensor names of the fused bucket whose node is ``site``, or None.

    The kernel's name carries the calling functions' prefixes
    (``StatefulPartitionedCall/MatexGroupedAllreduce``); the recorded name is
    the one inside the traced function, so the longest known suffix wins.
    """
    if not names or not site:
        return None
    parts = site.split("/")
    for i in range(len(parts)):
        found = names.get("/".join(parts[i:]))
        if found is not None:
            return found
    return None


def check_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` and prove a file can be written there; a clear TimelineError else."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / (".matex-timeline-probe.%d" % os.getpid())
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise TimelineError("matex.timeline: cannot write the timeline to %s: %s"
                            % (directory, exc.strerror or exc)) from None
    return directory
