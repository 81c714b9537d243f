"""Memory-mapped files: arrays that are views on a file's bytes.

Gathers through the mapping run at memory speed. The pages they touch are
the kernel's page cache (clean, shared, reclaimable), not memory the
reader allocates, so they are not counted in a DataSet's memory budget.
"""

import mmap
import os

import numpy as np


class MappedFile:
    """A file mapped read-only."""

    def __init__(self, path):
        self.path = path
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None

    def array(self, offset, dtype, shape, strides=None):
        """An ndarray view of the file at ``offset``."""
        return np.ndarray(shape, dtype=dtype, buffer=self._mmap, offset=offset, strides=strides)

    def column(self, offset, dtype, shape, strides=None):
        """A MappedColumn of the array at ``offset`` that knows where its rows lie in the file."""
        return MappedColumn(self.array(offset, dtype, shape, strides), place=(self.path, offset))

    def close(self):
        """Unmap, unless views of it are still alive (they keep it mapped until collected)."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass


class MappedColumn:
    """One field stored uncompressed and contiguous (or at a fixed stride) in a mapped file."""

    def __init__(self, array, place=None):
        self.array = array
        self.place = place      # (file, byte offset of row 0), or None when not known
        self.dtype, self.shape = array.dtype, array.shape[1:]
        self.num_rows = array.shape[0]
        self.unit_rows = 1
        self.decode_bytes = 0

    def gather(self, rows):
        """The rows ``rows`` (sorted), as a new array."""
        return np.take(self.array, rows, axis=0)

    def read_into(self, start, stop, out):
        """Copy rows ``[start, stop)`` into ``out``."""
        out[...] = self.array[start:stop]
