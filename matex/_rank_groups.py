"""One mechanism for groups of ranks.

A group is a sub-communicator cut from a parent communicator by one collective
``Split``, and held in a numbered slot of ``matex._runtime`` that the
collective ops name (their ``comm`` argument). Process sets
(``matex._process_sets``), the parallel grid's pipeline, tensor and world
groups (``matex.parallel``) and the science tools' rank groups
(``matex.science``) are all ``RankGroup`` objects:

* made on every rank of the parent at once; a rank outside the group passes
  ``color=None`` and holds neither communicator nor slot;
* cut again in place after a shrink (``rebuild``): the slot stays, so a traced
  function naming it needs no retrace, and the stale communicator is freed;
* released once (``release``, idempotent): the slot first, so no later op can
  name a freed communicator, then the communicator. One a failure left
  unusable is just dropped.
"""

from __future__ import annotations

from typing import Any, Optional

from matex import _runtime


def cut(parent: Any, color: Optional[int], key: Optional[int] = None) -> Any:
    """``parent.Split``: this rank's communicator among the ranks passing ``color``
    (``MPI.COMM_NULL`` for None), ordered by ``key`` (default: rank in ``parent``).
    Collective over ``parent``. For a group that becomes the communicator in use
    (``_runtime._set_comm``) rather than a slot's."""
    from mpi4py import MPI

    return parent.Split(MPI.UNDEFINED if color is None else color,
                        parent.Get_rank() if key is None else key)


def _free(comm: Any) -> None:
    from mpi4py import MPI

    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Free()
    except MPI.Exception:
        pass   # left unusable by a failure: nothing to release


class RankGroup:
    """This rank's part of a group of ranks: ``comm`` and the ``slot`` ops name it by.

    ``RankGroup(parent, color, key)`` is collective over ``parent``: the ranks
    that pass the same ``color`` form one group, ordered by ``key`` (default:
    their rank in ``parent``); ``color=None`` leaves this rank out (``member``
    False, ``comm`` and ``slot`` None).
    """

    def __init__(self, parent: Any, color: Optional[int], key: Optional[int] = None) -> None:
        self.comm: Any = None
        self.slot: Optional[int] = None
        self._take(cut(parent, color, key))

    @classmethod
    def adopt(cls, comm: Any) -> RankGroup:
        """A group over the communicator ``comm`` itself (local: no Split); it becomes
        the group's, freed by ``release``."""
        group = cls.__new__(cls)
        group.comm, group.slot = None, None
        group._take(comm)
        return group

    @property
    def member(self) -> bool:
        """Whether this rank belongs to the group."""
        return self.slot is not None

    def _take(self, sub: Any) -> None:
        from mpi4py import MPI

        if sub == MPI.COMM_NULL:
            return
        self.comm = sub
        self.slot = _runtime.register_comm(sub)   # sets MPI.ERRORS_RETURN on it

    def rebuild(self, parent: Any, color: Optional[int], key: Optional[int] = None) -> None:
        """Cut the group again from ``parent`` (collective over ``parent``; after a
        shrink), into the same slot; a rank no longer in it releases its part."""
        from mpi4py import MPI

        sub = cut(parent, color, key)
        if sub == MPI.COMM_NULL:
            self.release()
            return
        if self.slot is None:
            self._take(sub)
            return
        sub.Set_errhandler(MPI.ERRORS_RETURN)
        stale, self.comm = self.comm, sub
        _runtime.replace_comm(self.slot, sub)
        _free(stale)

    def revoke(self) -> None:
        """Revoke the communicator (ULFM), so a member blocked in it fails too. Never raises."""
        from mpi4py import MPI

        if self.comm is None:
            return
        try:
            self.comm.Revoke()
        except (MPI.Exception, NotImplementedError):
            pass   # already revoked or freed, or no ULFM

    def detach(self) -> Any:
        """Give the slot back and return the communicator, the caller's from now on
        (the grid hands its world back to ``_runtime``); None for a non-member."""
        slot, comm = self.slot, self.comm
        self.slot = self.comm = None
        if slot is not None:
            _runtime.release_comm(slot)
        return comm

    def release(self) -> None:
        """Give the slot back and free the communicator (local; idempotent)."""
        _free(self.detach())

    def __repr__(self) -> str:
        if not self.member:
            return "<RankGroup: not a member>"
        return "<RankGroup slot %d: rank %d of %d>" % (self.slot, self.comm.Get_rank(),
                                                        self.comm.Get_size())
