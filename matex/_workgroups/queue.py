"""Work items handed out to rank groups on request, one at a time per group (thread-safe).

The owner's handler for ``matex._workgroups.service.Server``: a group's
leader asks ``("next", (group, result))``, sending the result of the item it
held (None the first time), and gets the next item, ``"wait"`` (nothing to
hand out now, but an item still in flight may come back), None (no more work:
the group is finishing) or ``("error", message)`` (the run stops). Each
group's state is a ``GroupWork`` machine (waiting, running, finishing, lost);
a group with no rank left (ULFM) gives its item back to the queue.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Iterable, Optional

from matex._workgroups.machine import LOST, RUNNING, GroupWork


class WorkQueue:
    """``items`` handed out to ``groups`` groups; at most ``budget`` of them (None: all).

    Subclasses record results (``record``) and report progress (``finishing``).
    """

    def __init__(self, items: Iterable[Any], groups: int, budget: Optional[int] = None):
        self.pending = collections.deque(items)
        self.budget = len(self.pending) if budget is None else min(budget, len(self.pending))
        self.handed = 0
        self.work = [GroupWork(name="group %d" % g) for g in range(groups)]
        self.assigned = {}   # group -> the item it works on now
        self.error = None
        self.lock = threading.Lock()

    def __call__(self, op: str, args: tuple) -> Any:
        with self.lock:
            if op == "fail":
                return self._fail(*args)
            if op == "next":
                return self._next(*args)
            raise ValueError("matex: the work queue has no request %r" % (op,))

    def settled(self) -> int:
        """How many groups take no more work (finishing, done or lost)."""
        with self.lock:
            return sum(w.settled for w in self.work)

    def record(self, result: Any) -> None:
        """Hook: a group's result arrived (under the lock)."""

    def finishing(self, last: bool) -> None:
        """Hook: a group was told there is no more work (``last``: every group is settled)."""

    def _next(self, group: int, result: Any) -> Any:
        work = self.work[group]
        if result is not None:
            work.fire("complete")
            self.assigned.pop(group)
            self.record(result)
        if self.error is not None:
            work.fire("finish")
            return ("error", self.error)
        if not self.pending or self.handed >= self.budget:
            if self.assigned:
                return "wait"   # an item in flight may come back (its group lost)
            work.fire("finish")
            self.finishing(all(w.settled for w in self.work))
            return None
        work.fire("assign")
        self.handed += 1
        self.assigned[group] = self.pending.popleft()
        return self.assigned[group]

    def _fail(self, group: int, message: str) -> None:
        """The group's item failed: the run stops (every other group is told the error)."""
        self.error = self.error or message
        work = self.work[group]
        if work.state == RUNNING:
            self.assigned.pop(group, None)
            work.fire("fail")
        elif not work.settled:
            work.fire("finish")

    def stop(self, group: int, message: str) -> None:
        """The owner's own group stops with ``message`` (e.g. the owner raised)."""
        with self.lock:
            self._fail(group, message)

    def lose(self, groups: Iterable[int]) -> list:
        """Groups with no rank left (ULFM): their items go back first in the queue.

        Returns the groups newly lost (those already lost are skipped).
        """
        lost = []
        with self.lock:
            for group in sorted(set(groups)):
                work = self.work[group]
                if work.state == LOST:
                    continue
                work.fire("lose")
                lost.append(group)
                item = self.assigned.pop(group, None)
                if item is not None:
                    self.pending.appendleft(item)
                    self.handed -= 1
        return lost

