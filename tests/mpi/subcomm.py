"""Install a sub-communicator for a block, then the full one again (no ULFM needed)."""

from mpi4py import MPI

import matex
from matex import _runtime


class SubCommunicator:
    """``matex.comm()`` split by ``color(rank)`` inside the block; a copy of the old one after.

    Mimics what the resilience layer does after a shrink (``_runtime._set_comm``)
    on a healthy job. ``_set_comm`` may free the communicator it replaces, so
    the old one is duplicated first and the duplicate is installed afterwards.
    ``self.comm`` is this rank's sub-communicator.
    """

    def __init__(self, color):
        self.color = color

    def __enter__(self):
        world = matex.comm()
        self.restore = world.Dup()
        self.comm = world.Split(self.color(world.Get_rank()), world.Get_rank())
        _runtime._set_comm(self.comm)
        return self

    def __exit__(self, *exc):
        _runtime._set_comm(self.restore)
        if self.comm != MPI.COMM_NULL:          # not freed by _set_comm already
            self.comm.Free()
