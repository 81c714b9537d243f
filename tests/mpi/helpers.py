"""Shared helpers for the suites that run under mpiexec."""

import numpy as np

import matex


def gather(value):
    """Every rank's ``value`` (any picklable object), in rank order."""
    return matex.comm().allgather(value)


def all_equal_bytes(arrays):
    """Whether this rank's arrays are bitwise equal to every other rank's."""
    mine = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    everyone = matex.comm().allgather(mine)
    return all(other == everyone[0] for other in everyone)
