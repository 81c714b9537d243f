"""Reading sorted rows of a table within a memory bound.

Row-by-row tables are gathered directly. Unit tables decode whole units
into a fixed slab of slots: a batch pins the units it needs, their decodes
are submitted ahead of time, and unpinned units stay cached until their
slot is needed again (least recently used first).
"""

import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np


class SlabFull(Exception):
    """No free slot for a batch's units right now; retry after releasing a batch."""


def row_bytes(fields):
    """Bytes of one row of ``fields`` (name -> (dtype, shape))."""
    return sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for d, s in fields.values())


class Reader:
    """Reads ``table`` rows, caching at most ``capacity`` bytes of units; jobs go to ``submit``."""

    def __init__(self, table, capacity, submit):
        self.table, self._submit = table, submit
        self.by_row = table.unit_starts is None
        if self.by_row:
            return
        starts = np.asarray(table.unit_starts, dtype=np.int64)
        self._starts = starts
        self._lengths = np.append(starts[1:], table.num_rows) - starts
        self._slot_rows = int(self._lengths.max())
        self.slot_bytes = self._slot_rows * row_bytes(table.fields)
        self.slots = int(min(max(capacity // self.slot_bytes, 1), len(starts)))
        self._slabs = {name: np.empty((self.slots * self._slot_rows,) + tuple(shape), dtype)
                       for name, (dtype, shape) in table.fields.items()}
        self._slot_of = np.full(len(starts), -1, dtype=np.int64)
        self._unit_in = np.full(self.slots, -1, dtype=np.int64)
        self._pins = np.zeros(len(starts), dtype=np.int64)
        self._futures = {}
        self._free = list(range(self.slots))
        self._idle = OrderedDict()
        self._lock = threading.Lock()

    def typical_unit_rows(self):
        """Median rows of a unit (for sizing shuffle windows)."""
        return int(np.median(self._lengths))

    def _units(self, rows):
        units = np.searchsorted(self._starts, rows, side="right") - 1
        return units, units[np.r_[True, units[1:] != units[:-1]]] if len(units) else units

    def prefetch(self, rows):
        """Pin the units of sorted ``rows`` and start decoding the missing ones.

        Returns a token for ``release``; raises SlabFull when they do not fit now.
        """
        if self.by_row:
            return None
        _, units = self._units(rows)
        with self._lock:
            slots = self._slot_of[units]
            missing = units[slots < 0]
            idle_needed = sum(1 for s in slots[slots >= 0] if int(s) in self._idle)
            if len(missing) > len(self._free) + len(self._idle) - idle_needed:
                raise SlabFull()
            for s in slots[slots >= 0]:
                self._idle.pop(int(s), None)
            self._pins[units] += 1
            for unit in missing:
                slot = self._free.pop() if self._free else self._evict()
                self._slot_of[unit], self._unit_in[slot] = slot, unit
                self._futures[int(unit)] = self._submit(self._decode, int(unit), slot)
        return units

    def _evict(self):
        slot, _ = self._idle.popitem(last=False)
        old = int(self._unit_in[slot])
        self._slot_of[old] = -1
        self._futures.pop(old, None)
        return slot

    def _decode(self, unit, slot):
        base, length = slot * self._slot_rows, int(self._lengths[unit])
        self.table.read_unit(unit, {name: slab[base:base + length]
                                    for name, slab in self._slabs.items()})

    def preload(self, unit, fill):
        """Cache unit ``unit`` by calling ``fill(out)`` if a slot is free; whether it was."""
        with self._lock:
            if self.by_row or not self._free or self._slot_of[unit] >= 0:
                return False
            slot = self._free.pop()
            self._slot_of[unit], self._unit_in[slot] = slot, unit
        base, length = slot * self._slot_rows, int(self._lengths[unit])
        fill({name: slab[base:base + length] for name, slab in self._slabs.items()})
        done = Future()
        done.set_result(None)
        with self._lock:
            self._futures[unit] = done
            self._idle[slot] = None
        return True

    def release(self, token):
        """Unpin the units that ``prefetch`` pinned."""
        if token is None:
            return
        with self._lock:
            self._pins[token] -= 1
            for unit in token[self._pins[token] == 0]:
                self._idle[int(self._slot_of[unit])] = None

    def read(self, rows):
        """Fields of the sorted ``rows`` (pinned by ``prefetch``): name -> new array."""
        if self.by_row:
            return self.table.gather(rows)
        units, distinct = self._units(rows)
        for unit in distinct:
            self._futures[int(unit)].result()
        index = self._slot_of[units] * self._slot_rows + (rows - self._starts[units])
        return {name: np.take(slab, index, axis=0) for name, slab in self._slabs.items()}

    def read_through(self, rows):
        """Fields of the sorted ``rows`` decoding one unit at a time, bypassing the cache.

        For a group whose units outnumber the slots: slower, never stuck.
        """
        units, distinct = self._units(rows)
        out = {name: np.empty((len(rows),) + tuple(shape), dtype)
               for name, (dtype, shape) in self.table.fields.items()}
        cuts = np.searchsorted(units, distinct)
        for unit, begin, end in zip(distinct, cuts, np.append(cuts[1:], len(rows))):
            length = int(self._lengths[unit])
            scratch = {name: np.empty((length,) + tuple(shape), dtype)
                       for name, (dtype, shape) in self.table.fields.items()}
            self.table.read_unit(int(unit), scratch)
            local = rows[begin:end] - self._starts[unit]
            for name, values in scratch.items():
                out[name][begin:end] = values[local]
        return out
