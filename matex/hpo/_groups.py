"""The ranks of a search, split into groups that each train one trial at a time.

World rank ``r`` belongs to group ``r // k``; group rank 0 is the group's leader
(the only rank of the group that talks to the oracle). Three communicators:

* ``service``: a duplicate of the world taken before the split, for the oracle
  requests only, so they can never match a data collective;
* ``group``: the group's communicator, installed as MaTEx's data communicator
  (``matex.comm()``) while the search runs, so a trial's ``fit`` is
  data-parallel over its group with rank-0-of-group-only output;
* the world as it was, put back when the search ends.
"""

from __future__ import annotations

from matex import _runtime


def check_ranks_per_trial(k: int, size: int) -> int:
    """``k``, validated against ``size`` ranks (the same error on every rank)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError("ranks_per_trial must be a whole number >= 1, not %r" % (k,))
    if size % k:
        raise ValueError(
            "matex.hpo: ranks per trial (%d) does not divide the number of ranks (%d); "
            "choose a divisor of %d (e.g. %s)" % (
                k, size, size, ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)))
    return k


class Groups:
    """This rank's place in a search over ``k`` ranks per trial (collective to build)."""

    def __init__(self, k: int, world=None):
        self.world = world if world is not None else _runtime.comm()
        self.size = self.world.Get_size()
        self.k = check_ranks_per_trial(k, self.size)
        self.world_rank = self.world.Get_rank()
        self.count = self.size // self.k
        self.index = self.world_rank // self.k
        self.service = self.world.Dup()
        from mpi4py import MPI

        self.service.Set_errhandler(MPI.ERRORS_RETURN)
        self.owner_rank = 0   # service rank owning the oracle (a survivor after a takeover)
        self._saved = None

    @property
    def owner(self) -> bool:
        """Whether this rank owns the oracle (and is the only writer of the tuner directory)."""
        return self.service.Get_rank() == self.owner_rank

    def members(self, index: int) -> list:
        """Service ranks of group ``index``."""
        return list(range(index * self.k, (index + 1) * self.k))

    def enter(self):
        """Install this rank's group communicator as MaTEx's (collective over the world)."""
        world = _runtime.comm()
        self._saved = world.Dup()
        group = world.Split(self.index, world.Get_rank())
        _runtime._set_comm(group)

    def leave(self):
        """Put the world communicator back (collective over the survivors).

        Under ULFM the world is shrunk first: ranks lost during the search are
        not part of what comes after (``get_best_models``, more training).
        """
        if self._saved is not None:
            saved, self._saved = self._saved, None
            if _runtime.ft_mode() == "ulfm":
                shrunk = saved.Shrink()
                saved.Free()
                saved = shrunk
            _runtime._set_comm(saved)

    def shrink_service(self):
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
    def resilient(call):
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
