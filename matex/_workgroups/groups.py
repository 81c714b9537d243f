"""The ranks of a job split into groups of ``k`` that each work on one item at a time.

World rank ``r`` belongs to group ``r // k``; group rank 0 is the group's leader
(the only rank of the group that talks to the owner of the work). Service rank
``owner_rank`` (0 at first, a survivor after a takeover) owns the work and
answers the leaders (``matex._workgroups.service``). Communicators:

* ``service``: a duplicate of the world taken before the split, for the
  requests to the owner only, so they can never match a data collective;
* the group's communicator, installed as MaTEx's data communicator
  (``matex.comm()``) between ``enter`` and ``leave`` when a user wants it (a
  search: each trial's ``fit`` is data-parallel over its group);
* the world as it was, put back by ``leave``.

After a run that lost ranks (ULFM) the next one regroups the survivors
(``refresh``). Nothing here knows what a work item is (a trial, a grid point).
"""

from __future__ import annotations

from typing import Any, Callable

from matex import _runtime
from matex._rank_groups import cut


def check_group_size(k: Any, size: int, argument: str = "ranks per group",
                     label: str = "matex: ranks per group") -> int:
    """``k``, validated against ``size`` ranks (the same error on every rank).

    ``argument`` names the setting in the "whole number" error, ``label`` in
    the "does not divide" one (e.g. "matex.hpo: ranks per trial").
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError("%s must be a whole number >= 1, not %r" % (argument, k))
    if size % k:
        raise ValueError(
            "%s (%d) does not divide the number of ranks (%d); choose a divisor of %d (e.g. %s)"
            % (label, k, size, size,
               ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)))
    return k


def as_launched(size: int) -> int:
    """The rank count groups are made for: ``size``, or the count ``matexrun --ft`` first
    launched the job with when it relaunched it on fewer ranks (a rank died while MPI
    started); the ranks missing are then lost ranks of those groups (``refresh``)."""
    from matex import _config

    first = _config.relaunched_from()
    return first if first is not None and first > size and world_is_launch(size) else size


def world_is_launch(size: int) -> bool:
    """Whether ``size`` is the whole job as (re)launched (not a shrink after it)."""
    from mpi4py import MPI

    return size == MPI.COMM_WORLD.Get_size()


class Groups:
    """This rank's place among groups of ``k`` ranks (collective over ``world`` to build).

    ``k`` must divide the number of ranks (``check_group_size``; callers with
    their own wording check first).
    """

    def __init__(self, k: int, world=None):
        from mpi4py import MPI

        from matex import _resilience

        # A rank lost before the groups exist (ULFM): the survivors all see it (an
        # agreed outcome), shrink the world as the recovery loop does, and group
        # themselves as a loss inside the work regroups them (``refresh``). A world
        # given by the caller is not replaced: a loss there is one error everywhere.
        first = world if world is not None else _runtime.comm()
        launched = (first.Get_rank(), as_launched(first.Get_size()))
        service = _resilience.uniformly(
            lambda c: c.Dup(), comm=(lambda: world) if world is not None else _runtime.comm,
            attempts=1 if world is not None else 8, discard=lambda c: c.Free())
        self.world = world if world is not None else _runtime.comm()
        self.world_rank, self.size = launched   # the groups as launched; refresh below
        self.k = check_group_size(k, self.size)
        self.count = self.size // self.k
        self.index = self.world_rank // self.k
        self._members = [list(range(g * self.k, (g + 1) * self.k)) for g in range(self.count)]
        self.service = service
        self.service.Set_errhandler(MPI.ERRORS_RETURN)
        self.owner_rank = 0   # service rank owning the work (a survivor after a takeover)
        self._saved = None
        if self.world.Get_size() != self.size:
            self.refresh()   # ranks lost while the groups were made: the survivors' groups

    @property
    def owner(self) -> bool:
        """Whether this rank owns the work (and is its only writer)."""
        return self.service.Get_rank() == self.owner_rank

    def members(self, index: int) -> list:
        """Service ranks of group ``index``."""
        return list(self._members[index])

    def lost(self, dead) -> set:
        """Indices of the groups none of whose ranks is alive (``dead``: service ranks)."""
        dead = set(dead)
        return {g for g in range(self.count) if set(self._members[g]) <= dead}

    def refresh(self) -> bool:
        """Before a run: the groups among the ranks alive now (collective over them).

        After a run that lost ranks (ULFM) the world and the service
        communicator are the survivors, renumbered: each survivor stays with
        its group, groups with no rank left are gone, and the groups are
        numbered again from 0. Returns whether anything changed.
        """
        world = _runtime.comm()
        if world.Get_size() == self.size:
            return False
        indices = world.allgather(self.index)   # every survivor's group, by its new rank
        alive = sorted(set(indices))
        self._members = [[r for r, i in enumerate(indices) if i == g] for g in alive]
        self.index = alive.index(self.index)
        self.count = len(alive)
        self.size = world.Get_size()
        self.world_rank = world.Get_rank()
        self.owner_rank = 0
        return True

    def enter(self) -> None:
        """Install this rank's group communicator as MaTEx's (collective over the world)."""
        world = _runtime.comm()
        self._saved = world.Dup()
        group = cut(world, self.index)
        self._entering()
        _runtime._set_comm(group)

    def leave(self) -> None:
        """Put the world communicator back (collective over the survivors).

        Under ULFM the world is shrunk first: ranks lost meanwhile are not part
        of what comes after.
        """
        if self._saved is not None:
            saved, self._saved = self._saved, None
            self._leaving()
            if _runtime.ft_mode() == "ulfm":
                shrunk = saved.Shrink()
                saved.Free()
                saved = shrunk
            _runtime._set_comm(saved)

    def _entering(self) -> None:
        """Hook: just before the group's communicator is installed (subclasses)."""

    def _leaving(self) -> None:
        """Hook: just before the world's communicator is put back (subclasses)."""

    def shrink_service(self) -> None:
        """Under ULFM: the service communicator without the lost ranks (collective).

        The owner is then its rank 0: an owner is always the lowest rank alive
        when it takes over, and ranks never come back.
        """
        if _runtime.ft_mode() != "ulfm":
            return
        from mpi4py import MPI

        old, self.service = self.service, self.service.Shrink()
        self.service.Set_errhandler(MPI.ERRORS_RETURN)
        old.Free()
        self.owner_rank = 0

    @staticmethod
    def resilient(call: Callable[[], Any]) -> Any:
        """``call()`` over the group; after a rank failure (ULFM) shrink the group and redo it."""
        from matex import _resilience

        for attempt in range(8):
            try:
                return call()
            except Exception as exc:
                # the recovery loop's own test: under ULFM an MPI error of another
                # class while a failure is known is that failure too
                if not _resilience.is_failure(exc) or _runtime.ft_mode() != "ulfm" \
                        or attempt == 7:
                    raise
                _resilience.recover()

    @staticmethod
    def leader() -> bool:
        """Whether this rank leads its group now (group rank 0; changes after a shrink)."""
        return _runtime.rank() == 0
