"""``horovod.tensorflow.mpi_ops``: the collectives and process functions, by Horovod's module.

The same objects as ``matex.horovod.tensorflow`` (scripts and Horovod's tests import
some names from here), and ``_basics``: the process-set queries of Horovod's
``HorovodBasics`` that its tests call.
"""

from __future__ import annotations

from matex import _process_sets
from matex.horovod._api import (ProcessSet, add_process_set, allgather, allreduce,  # noqa: F401
                                broadcast, global_process_set, grouped_allreduce, init,
                                local_rank, local_size, process_set_included_op, rank, rank_op,
                                remove_process_set, size, size_op)


class _Basics:
    """Horovod's ``HorovodBasics`` process-set queries, on ``matex._process_sets``."""

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """``{id: ranks}`` of every registered process set, the global one (0) included."""
        return _process_sets.table()

    @staticmethod
    def _process_set_size(process_set_id: int) -> int:
        """The number of ranks of the set (ValueError for an unknown id)."""
        return _process_sets.get(process_set_id).size() or 0

    @staticmethod
    def _process_set_rank(process_set_id: int) -> int:
        """This rank's index in the set (ValueError outside it or for an unknown id)."""
        return _process_sets.get(process_set_id).rank() or 0


_basics = _Basics()
