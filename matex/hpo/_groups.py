"""A search's rank groups, and how a trial ends without leaving a peer in a collective.

The groups themselves (world rank ``r`` in group ``r // k``, the owner, the
leaders, the service communicator, regrouping after a shrink) are
``matex._workgroups.groups.Groups``; a search's ``TrialGroups`` adds what a
trial needs while the group's communicator is MaTEx's: every collective of a
trial is agreed on first over the group's communicator, so that a rank whose
trial raised can release the peers waiting for it (``finish_trial``, below).
"""

from __future__ import annotations

from typing import Any

from matex import _runtime, _state
from matex._workgroups.groups import Groups, as_launched, check_group_size


def check_ranks_per_trial(k: Any, size: int) -> int:
    """``k``, validated against ``size`` ranks (the same error on every rank)."""
    return check_group_size(k, size, argument="ranks_per_trial",
                            label="matex.hpo: ranks per trial")


class TrialGroups(Groups):
    """This rank's place in a search over ``k`` ranks per trial (collective to build).

    While the group's communicator is MaTEx's (``enter`` .. ``leave``), every
    collective of a trial is agreed on first (see ``finish_trial``).
    """

    def __init__(self, k: int, world=None):
        check_ranks_per_trial(k, as_launched(
            (world if world is not None else _runtime.comm()).Get_size()))
        super().__init__(k, world)   # world None: the survivors', if a rank is lost meanwhile

    def _entering(self) -> None:
        _runtime.set_control_class(checked_class())
        _checking.append(None)
        _runtime.on_core_ready(_force_check)

    def _leaving(self) -> None:
        _runtime.set_control_class(None)
        _restore_check()


# while a search runs: the C++ agreement check's setting before it
_checking = _state.table("hpo.groups.checking", lifetime="process", factory=list)


def _force_check(core):
    """The C++ core's agreement check on while a search runs (the trial-end protocol needs it)."""
    if _checking and _checking[-1] is None:
        _checking[-1] = core.agreement_check()
        core.set_agreement_check(True)


def _restore_check():
    from matex import _native

    if _checking:
        before = _checking.pop()
        core = _native.loaded()
        if before is not None and core is not None:
            core.set_agreement_check(before)


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
_checked = _state.table("hpo.groups.checked", lifetime="process", factory=list)   # the class


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
