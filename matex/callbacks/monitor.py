"""MonitorCallback: live figures for the whole job (samples/s, slowest rank, allreduce share).

Each rank times its own steps and reads, from the flight recorder, how long
its collectives took and how long it waited in them for the other ranks. Every
few steps (as many as take about ``interval`` seconds; rank 0 picks the count
and every rank learns it in the same exchange) the ranks exchange these
totals in one small allgather on the control communicator, so there is no
per-step collective. Rank 0 prints, every ``interval`` seconds, one line::

    matex monitor: step 120: 5230 samples/s; slowest rank 1 (+3.2 ms/step); allreduce 12% of step

The same figures, over each epoch, go into the epoch logs (so into
``History`` and ``TensorBoard``): ``matex_samples_per_s``,
``matex_slowest_rank``, ``matex_slowest_lag_ms`` and
``matex_allreduce_share``. The slowest rank is the one the others wait for
(it waits least in the collectives); its lag is how much longer per step the
rank that waited most spent waiting than it.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

import keras

if TYPE_CHECKING:
    from mpi4py import MPI

RING_SHARE = 0.5   # exchange before half of the recorder's ring is new entries


class _Totals:
    """This rank's sums over a stretch of steps."""

    def __init__(self):
        self.steps, self.step_s, self.collective_s, self.wait_s = 0, 0.0, 0.0, 0.0
        self.collectives = 0
        self.since = time.time()

    def as_tuple(self):
        return (self.steps, self.step_s, self.collective_s, self.wait_s)

    def add(self, other: "_Totals"):
        self.steps += other.steps
        self.step_s += other.step_s
        self.collective_s += other.collective_s
        self.wait_s += other.wait_s
        self.collectives += other.collectives


def figures(gathered: list, global_batch: int | None, elapsed: float) -> dict:
    """The job's figures from every rank's ``(steps, step_s, collective_s, wait_s)``."""
    steps = max(t[0] for t in gathered)
    if not steps:
        return {}
    waits = [t[3] for t in gathered]
    slowest = min(range(len(waits)), key=waits.__getitem__)
    shares = [t[2] / t[1] for t in gathered if t[1] > 0]
    rate = steps / elapsed if elapsed > 0 else 0.0
    return {
        ("matex_samples_per_s" if global_batch else "matex_steps_per_s"):
            rate * (global_batch or 1),
        "matex_slowest_rank": slowest,
        "matex_slowest_lag_ms": (max(waits) - waits[slowest]) / steps * 1e3,
        "matex_allreduce_share": sum(shares) / len(shares) if shares else 0.0,
    }


class MonitorCallback(keras.callbacks.Callback):
    """See the module docstring. ``fit`` adds it on every rank under ``MATEX_MONITOR=1``.

    Args:
      global_batch: samples per step for the whole job; None when unknown (a dataset
        the script batches itself): steps/s (``matex_steps_per_s``) instead.
      interval: seconds between rank 0's lines (default ``MATEX_MONITOR_INTERVAL``).
      stream: where rank 0 writes (default stderr, apart from Keras's progress bar).
    """

    def __init__(self, global_batch: int | None, interval: float | None = None,
                 stream: TextIO | None = None) -> None:
        super().__init__()
        from matex import _config

        self.global_batch = int(global_batch) if global_batch else None
        self.interval = _config.monitor_interval() if interval is None else float(interval)
        self.stream = stream
        self.step = 0
        self.every = 1          # steps between exchanges (rank 0 decides, all follow)
        self.next_exchange = 1
        self.last_line = 0.0
        self.line_steps = _Totals()
        self.epoch_totals = _Totals()
        self.pending = _Totals()
        self.latest: dict = {}

    @property
    def control(self) -> MPI.Intracomm:
        """The control communicator in use now (a recovery replaces it: never cached)."""
        from matex import _runtime

        return _runtime.control()

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Start (or, after a recovery re-runs ``fit``, restart) the exchange schedule.

        Every rank comes here at the same point of training, so every rank
        restarts the count alike: the next exchange is after the next step.
        A survivor that finished a step the others redo after a rank loss
        would otherwise count one step more and meet their step's allgather
        with its epoch's, or wait for ever.
        """
        from matex import _runtime

        self.core = _runtime._core()
        self.rank = self.control.Get_rank()
        if self.core.flight_capacity() == 0:
            self.core.set_flight_capacity(1024)   # the figures come from the recorder
        self.seen = self.core.flight_sequence()
        self.last_line = time.time()
        self.line_steps = _Totals()
        self.pending = _Totals()
        self.every = 1
        self.next_exchange = self.step + 1

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch_totals = _Totals()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.pending.step_s += time.perf_counter() - self.t0
        self.pending.steps += 1
        self.step += 1
        if self.step >= self.next_exchange:
            self._exchange()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._exchange()
        gathered = self.control.allgather(self.epoch_totals.as_tuple())
        found = figures(gathered, self.global_batch, time.time() - self.epoch_totals.since)
        if logs is not None:
            logs.update(found)

    def _read_collectives(self):
        """Add the collectives finished since the last read to the pending totals."""
        for e in self.core.flight_entries():
            if e["seq"] <= self.seen or e["state"] == 0:
                continue
            self.pending.collective_s += e["end"] - e["start"]
            self.pending.wait_s += (e["agreed"] or e["end"]) - e["start"]
            self.pending.collectives += 1
            self.seen = e["seq"]

    def _exchange(self):
        """Totals of every rank since the last exchange; rank 0 may print; next exchange set."""
        self._read_collectives()
        mine = self.pending
        self.pending = _Totals()
        self.epoch_totals.add(mine)
        self.line_steps.add(mine)
        proposal, due = 0, False
        if self.rank == 0:
            now = time.time()
            due = now - self.last_line >= self.interval
            if mine.steps:
                per_step = (now - mine.since) / mine.steps
                per_step_collectives = max(mine.collectives / mine.steps, 1.0)
                ring = max(self.core.flight_capacity() * RING_SHARE, 1.0)
                proposal = max(1, min(int(self.interval / 2 / per_step) if per_step > 0 else 1,
                                      int(ring / per_step_collectives)))
        gathered = self.control.allgather(self.line_steps.as_tuple() + (proposal, due))
        self.every = max(1, gathered[0][4] or self.every)
        self.next_exchange = self.step + self.every
        if not gathered[0][5]:
            return
        now = time.time()
        found = figures([g[:4] for g in gathered], self.global_batch, now - self.last_line)
        self.latest = found
        if self.rank == 0 and found:
            stream = self.stream or sys.stderr
            rate = "%.0f samples/s" % found["matex_samples_per_s"] if self.global_batch else (
                "%.1f steps/s" % found["matex_steps_per_s"])
            stream.write("matex monitor: step %d: %s; slowest rank %d "
                         "(+%.1f ms/step); allreduce %.0f%% of step\n"
                         % (self.step, rate,
                            found["matex_slowest_rank"], found["matex_slowest_lag_ms"],
                            100 * found["matex_allreduce_share"]))
            stream.flush()
        self.last_line = now
        self.line_steps = _Totals()
