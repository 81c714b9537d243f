"""``horovod.runner.common.util.env``: the launcher's environment, read before ``init``."""

from __future__ import annotations

import os

_RANK_SIZE = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size() -> tuple[int, int]:
    """This process's (rank, size) from the launcher's variables, without starting MPI.

    The first pair present of Horovod's, Open MPI's and PMI's; (0, 1) when none is
    (one process). Only one of a pair set is a RuntimeError, as in Horovod.
    """
    for rank_var, size_var in _RANK_SIZE:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError("Could not determine process rank and size: only one of %s and "
                               "%s found in environment" % (rank_var, size_var))
    return 0, 1
