"""The ranks of a search, split into groups that each train one trial at a time.

World rank ``r`` belongs to group ``r // k``; group rank 0 is the group's leader
(the only rank of the group that talks to the oracle). Three communicators:

* ``service``: a duplicate of the world taken before the split, for the oracle
  requests only, so they can never match a data collective;
* ``group``: the group's communicator, installed as MaTEx's data communicator
  (``matex.comm()``) while the search runs, so a trial's ``fit`` is
  data-parallel over its group with rank-0-of-group-only output;
* the world as it was, put back when the search ends.

While the search runs, every collective of a trial is agreed on first over the
group's communicator, so that a rank whose trial raised can release the peers
waiting for it (``finish_trial``, below); after a search that lost ranks
(ULFM) the next one regroups the survivors (``Groups.refresh``).
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
        self._members = [list(range(g * self.k, (g + 1) * self.k)) for g in range(self.count)]
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
        return list(self._members[index])

    def refresh(self) -> bool:
        """Before a search: the groups among the ranks alive now (collective over them).

        After a search that lost ranks (ULFM) the world and the service
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

    def enter(self):
        """Install this rank's group communicator as MaTEx's (collective over the world)."""
        world = _runtime.comm()
        self._saved = world.Dup()
        group = world.Split(self.index, world.Get_rank())
        # every collective of a trial is agreed on first (see finish_trial below)
        _runtime.control_class = checked_class()
        _checking.append(None)
        _runtime.on_core_ready(_force_check)
        _runtime._set_comm(group)

    def leave(self):
        """Put the world communicator back (collective over the survivors).

        Under ULFM the world is shrunk first: ranks lost during the search are
        not part of what comes after (``get_best_models``, more training).
        """
        if self._saved is not None:
            saved, self._saved = self._saved, None
            _runtime.control_class = None
            _restore_check()
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


_checking = []   # while a search runs: the C++ agreement check's setting before it


def _force_check(core):
    """The C++ core's agreement check on while a search runs (the trial-end protocol needs it)."""
    if _checking and _checking[-1] is None:
        _checking[-1] = core.agreement_check()
        core.set_agreement_check(True)


def _restore_check():
    from matex import _native

    if _checking:
        before = _checking.pop()
        if before is not None and _native._core is not None:
            _native._core.set_agreement_check(before)


# ---- leaving a trial without leaving a peer stuck in a collective ----------------------
#
# Plain MPI cannot interrupt a blocked collective: a peer waiting in one leaves it only
# when every rank of the communicator makes the matching call. So while a search runs,
# every collective of a trial begins with the same small agreement on the group's data
# communicator: MaTEx's own ops already do (the C++ agreement check: an Iallreduce of
# (h, -h) under MPI_MAX, then on a mismatch an Allgather of 160-character descriptions),
# and Python-level collectives do the same check first (``checked_class``: the control
# communicator of a search, and the ``comm`` that ``minimize`` hands its function). A
# rank whose trial is over, however it ended, keeps joining these checks with "trial
# over" (``finish_trial``) until every rank of the group is at the end: a peer blocked
# in a collective's check then meets a mismatch, raises, and reaches the end too.
#
# Not covered (a hang remains possible there): a collective that skips the check: a
# communicator the trial made itself with Split/Create (Dup of a checked one is
# checked), a MaTEx op on another slot (model-parallel groups), or the agreement check
# turned off in the C++ core (a search turns it on); and a rank that raises *between* a
# collective's check and the collective itself (e.g. an object that cannot be pickled).

TRIAL_OVER = "matex.hpo: this rank's trial is over"
_TEXT = 160   # kLen of the C++ agreement report (tf_ops/core/internal.h)


def _signature(text: str) -> int:
    """A non-negative 62-bit FNV-1a hash of ``text`` (the check's ``h``)."""
    h = 1469598103934665603
    for byte in text.encode():
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h >> 2


def agree_on(comm, text: str):
    """The agreement check, as the C++ core runs it, on ``comm`` (collective).

    None when every rank passed the same ``text``; otherwise every rank's text
    (a list, indexed by rank), exchanged as the core's mismatch report is.
    """
    import numpy as np
    from mpi4py import MPI

    h = _signature(text)
    v = np.array([h, -h], dtype=np.int64)
    comm.Iallreduce(MPI.IN_PLACE, [v, MPI.INT64_T], op=MPI.MAX).Wait()
    if v[0] == -v[1]:
        return None
    mine = np.zeros(_TEXT, dtype=np.uint8)
    raw = text.encode()[:_TEXT - 1]
    mine[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    everyone = np.zeros(_TEXT * comm.Get_size(), dtype=np.uint8)
    comm.Allgather([mine, MPI.CHAR], [everyone, MPI.CHAR])
    return [bytes(everyone[r * _TEXT:(r + 1) * _TEXT]).split(b"\0", 1)[0].decode(
        errors="replace") for r in range(comm.Get_size())]


def check_collective(what: str):
    """Before a Python-level collective of a trial: agree on it over the data communicator.

    Raises ``MismatchError`` on every rank of the group when they disagree,
    e.g. when a peer's trial is over (it raised) while this rank goes on.
    """
    from matex.errors import MismatchError

    texts = agree_on(_runtime.comm(), what)
    if texts is not None:
        raise MismatchError(
            "ranks disagree on the collective to run: %s" % "; ".join(
                "rank %d: %s" % (r, t) for r, t in enumerate(texts)))


def finish_trial(comm) -> set:
    """Wait at the end of a trial until every rank of ``comm`` is there (collective).

    A rank still inside the trial is released from the collective it waits in
    (it raises there, and comes here). Returns the ranks this rank released
    (their failure is a consequence of another rank's, not the trial's cause).
    """
    released = set()
    while True:
        texts = agree_on(comm, TRIAL_OVER)
        if texts is None:
            return released
        released |= {r for r, t in enumerate(texts) if t != TRIAL_OVER}


_COLLECTIVES = (
    "barrier", "bcast", "gather", "scatter", "allgather", "alltoall", "reduce", "allreduce",
    "scan", "exscan", "Barrier", "Bcast", "Gather", "Gatherv", "Scatter", "Scatterv",
    "Allgather", "Allgatherv", "Alltoall", "Alltoallv", "Alltoallw", "Reduce", "Allreduce",
    "Reduce_scatter", "Reduce_scatter_block", "Scan", "Exscan")
_checked = []


def checked_class():
    """An ``mpi4py`` ``Intracomm`` subclass whose collectives start with ``check_collective``.

    ``checked_class()(comm)`` shares ``comm``'s handle (no copy); ``Dup`` keeps the class.
    """
    if _checked:
        return _checked[0]
    from mpi4py import MPI

    def checked(name):
        base = getattr(MPI.Intracomm, name)

        def method(self, *args, **kwargs):
            check_collective("python %s" % name)
            return base(self, *args, **kwargs)

        method.__name__ = name
        method.__doc__ = base.__doc__
        return method

    namespace = {name: checked(name) for name in _COLLECTIVES}
    namespace["__doc__"] = "A communicator of a trial: every collective is agreed on first."
    _checked.append(type("TrialComm", (MPI.Intracomm,), namespace))
    return _checked[0]
