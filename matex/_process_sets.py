"""Process sets: subsets of MaTEx's ranks that run collectives among themselves.

A process set is a sorted list of ranks of ``matex.comm()`` with a numeric id
(0 is the global set: every rank). Each set other than the global one gets a
sub-communicator in a communicator slot (``matex._runtime.register_comm``) on
its members; its collectives are MaTEx's ordinary collectives called with
``comm=slot``. This is Horovod's ``hvd.ProcessSet`` model (``matex.horovod``
maps its names onto this module):

* sets are created and removed collectively, by every rank, in the same
  order (``add``, ``remove``), so that ids agree across ranks; the lowest free
  id is reused; a set with the ranks of an existing one is a ValueError;
* a rank outside a set that calls one of its collectives gets
  ``tf.errors.InvalidArgumentError`` on that rank (``slot_of``);
* ranks are global ranks (``matex.rank()``); ``ProcessSet.rank()`` is the
  rank within the set.

After a rank loss under ULFM (``matexrun --ft``) every set keeps working over
its surviving members: the recovery revokes the sets' communicators with the
data communicator (its veto hook, which raises nothing here), and once the
survivors' communicator is installed, the ``on_rank_loss`` listener rebuilds
each set's communicator from the members still alive, in the same slot (a
traced function that names the slot needs no retrace). Members are renumbered
as the global ranks are: ``ranks`` become the survivors' new global ranks,
in the same order.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from matex import _resilience, _runtime, _state
from matex._rank_groups import RankGroup
from matex._everywhere import agree_error

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["ProcessSet", "global_process_set", "add", "remove", "init_sets", "get",
           "slot_of", "root_in", "table"]

_lock = threading.RLock()


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Build it from global ranks (any iterable of ints; sorted) or from an
    mpi4py communicator (its ranks; only in ``init_sets``/``add``, where each
    rank may pass a different communicator, e.g. the halves of a ``Split``),
    then register it with ``add`` (or ``hvd.init(process_sets=...)``), which
    sets ``process_set_id``.
    """

    process_set_id: Optional[int]
    ranks: Optional[list[int]]
    mpi_comm: Optional[MPI.Comm]

    def __init__(self, ranks_or_comm: Union[Iterable[int], MPI.Comm]) -> None:
        self.process_set_id = None
        self.ranks = None
        self.mpi_comm = None
        self._group: Optional[RankGroup] = None   # this rank's part of the set, once built
        self._world: list[int] = []        # the members' MPI_COMM_WORLD ranks (survive shrinks)
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)   # type: ignore[arg-type]
        except TypeError:
            raise ValueError("ProcessSet takes a list of process ranks or an mpi4py "
                             "communicator, not %r" % (ranks_or_comm,)) from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError("ProcessSet takes a list of integer ranks, not %r" % (ranks,))
        self.ranks = ranks

    def size(self) -> Optional[int]:
        """The number of ranks in the set, or None while it is not registered."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _runtime.size()
        return len(self.ranks or ())

    def rank(self) -> Optional[int]:
        """This rank's index in the set (None while not registered).

        Raises:
          ValueError: this rank is not a member (as Horovod).
        """
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _runtime.rank()
        me = _runtime.rank()
        if me not in (self.ranks or ()):
            raise ValueError("Process is not part of provided process set: rank %d, %s"
                             % (me, self))
        return (self.ranks or []).index(me)

    def included(self) -> Optional[bool]:
        """Whether this rank is a member (None when the set has no ranks yet)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return _runtime.rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        ranks = self.ranks
        if self.process_set_id == 0 and _runtime.started():
            ranks = list(range(_runtime.size()))
        return "ProcessSet(process_set_id=%s, ranks=%s, mpi_comm=%s)" % (
            self.process_set_id, ranks, self.mpi_comm)

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

# id (>= 1) -> registered set, identical on every rank
_sets: dict[int, ProcessSet] = _state.table("process_sets.sets", lifetime="process")
_now = _state.namespace("process_sets", watching=False)   # whether the recovery hooks are installed


def _comm():
    return _runtime.control()   # same ranks as matex.comm(), kept apart from data collectives


def _views(ps: ProcessSet, comm) -> list[tuple[int, ...]]:
    """The rank lists ``ps`` stands for across ranks (one, or one per distinct communicator)."""
    from mpi4py import MPI

    if ps.ranks is not None:
        return [tuple(ps.ranks)]
    mine = MPI.Group.Translate_ranks(ps.mpi_comm.Get_group(),
                                     list(range(ps.mpi_comm.Get_size())), comm.Get_group())
    if any(r == MPI.UNDEFINED or r < 0 for r in mine):
        raise ValueError("ProcessSet's communicator has ranks outside MaTEx's communicator")
    return [tuple(sorted(mine))]


def _check_ranks(ranks: Sequence[int], size: int) -> None:
    if not ranks:
        raise ValueError("a process set needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError("a process set lists a rank twice: %s" % (list(ranks),))
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError("process set ranks %s are outside [0, %d)" % (bad, size))


def _agreed_views(entries: Sequence[ProcessSet], comm) -> list[list[tuple[int, ...]]]:
    """Per entry, the distinct rank lists it stands for on the ranks (collective).

    A ranks-built entry must list the same ranks everywhere; a communicator-
    built entry may differ per rank (each passes its own part of a split), but
    the parts must be consistent: every member of a part passed that part.
    Any error is a ValueError on every rank.
    """
    size = comm.Get_size()
    own: Optional[BaseException] = None
    mine: list[Any] = []
    try:
        for ps in entries:
            if not isinstance(ps, ProcessSet):
                raise ValueError("process sets must be hvd.ProcessSet objects, not %r" % (ps,))
            (view,) = _views(ps, comm)
            _check_ranks(view, size)
            mine.append((ps.ranks is None, view))
    except Exception as exc:  # noqa: BLE001 - one error on every rank
        own = exc
    agree_error(comm, own, error_type=ValueError, what="matex process sets")
    everyone = comm.allgather(mine)
    own = None
    result = []
    try:
        if len({len(e) for e in everyone}) != 1:
            raise ValueError("ranks pass different numbers of process sets: %s"
                             % [len(e) for e in everyone])
        for i in range(len(entries)):
            kinds = {e[i][0] for e in everyone}
            views = [e[i][1] for e in everyone]
            if kinds != {False} and kinds != {True}:
                raise ValueError("process set %d is built from ranks on some ranks and from "
                                 "a communicator on others" % i)
            if kinds == {False} and len(set(views)) != 1:
                raise ValueError("ranks disagree on process set %d: %s"
                                 % (i, sorted(set(views))))
            for r, view in enumerate(views):
                if kinds == {True} and r not in view:
                    raise ValueError("process set %d: rank %d's communicator does not "
                                     "contain it" % (i, r))
                if any(views[m] != view for m in view):
                    raise ValueError("process set %d: the members of %s passed different "
                                     "communicators" % (i, list(view)))
            result.append(sorted(set(views)))
    except Exception as exc:  # noqa: BLE001 - the same data on every rank: the same error
        own = exc
    agree_error(comm, own, error_type=ValueError, what="matex process sets")
    return result


def _world_ranks(ranks: Sequence[int], comm) -> list[int]:
    from mpi4py import MPI

    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(ranks),
                                          MPI.COMM_WORLD.Get_group()))


def _build(ps: ProcessSet, comm) -> None:
    """Give ``ps`` (ranks set) its communicator on its members (collective over ``comm``)."""
    ranks = ps.ranks or []
    ps._group = RankGroup(comm, 0 if comm.Get_rank() in ranks else None)
    ps._world = _world_ranks(ranks, comm)


def _new_id() -> int:
    return min(set(range(1, len(_sets) + 2)) - set(_sets))


def _install(view: Sequence[int], comm, ps: Optional[ProcessSet] = None) -> ProcessSet:
    """Register the rank list ``view`` (as ``ps``, or a new object): build, number it."""
    if ps is None:
        ps = ProcessSet(view)
    ps.ranks = list(view)
    _build(ps, comm)
    ps.process_set_id = _new_id()
    _sets[ps.process_set_id] = ps
    return ps


def _watch() -> None:
    """Install the recovery hooks once (on every rank: the first ``add`` is collective)."""
    if not _now.watching:
        _now.watching = True
        _resilience.add_recovery_veto(_revoke_all)
        _resilience.on_rank_loss(_rebuild_all)


def _register(entries: Sequence[ProcessSet], duplicate_error: bool) -> list[ProcessSet]:
    """Register ``entries`` collectively; returns them with ids (see ``add``/``init_sets``)."""
    with _lock:
        comm = _comm()
        views = _agreed_views(entries, comm)
        size = comm.Get_size()
        existing = {tuple(ps.ranks or ()): ps for ps in _sets.values()}
        existing[tuple(range(size))] = global_process_set
        out = []
        seen = {0}   # ids this rank's entries took (init): a second one is a duplicate
        for ps, distinct in zip(entries, views):
            mine = next((v for v in distinct if comm.Get_rank() in v), distinct[0])
            for view in distinct:
                if view in existing:
                    if duplicate_error:
                        raise ValueError("Attempted to add a duplicate process set: %s (the "
                                         "same ranks as %s)" % (list(view), existing[view]))
                    if view == mine:   # Horovod's init: the registered set, unless taken
                        sid = existing[view].process_set_id
                        if sid in seen:
                            ps._invalidate()
                        else:
                            ps.process_set_id = sid
                            seen.add(sid)
                    continue
                made = _install(view, comm, ps if view == mine else None)
                existing[view] = made
                if view == mine:
                    seen.add(made.process_set_id)
            if ps.ranks is None:
                ps.ranks = list(mine)
            out.append(ps)
        _watch()
        return out


def add(process_set: Union[ProcessSet, Iterable[int]]) -> ProcessSet:
    """Register a process set, on every rank (collective over ``matex.comm()``); return it.

    ``process_set``: a ``ProcessSet`` or global ranks. Every rank calls it
    with the same ranks (or, for a communicator-built set, its own part).

    Raises:
      ValueError: on every rank, for ranks that disagree across ranks, are
        out of range or repeated, or the ranks of a set that exists already
        (the global set included).
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None and _sets.get(ps.process_set_id) is ps:
        raise ValueError("Attempted to add a duplicate process set: %s" % (ps,))
    return _register([ps], duplicate_error=True)[0]


def init_sets(process_sets: Sequence[ProcessSet]) -> None:
    """Register ``process_sets`` at start-up (Horovod's ``hvd.init(process_sets=...)``).

    Collective. An entry with the ranks of a set registered before (by an
    earlier ``init``) stands for that set; one with the ranks of the global set
    or of an earlier entry is a ValueError naming it, on the ranks where it is
    (as Horovod does).
    """
    entries = list(process_sets)
    _register(entries, duplicate_error=False)
    for i, ps in enumerate(entries):
        if ps.process_set_id is None:
            raise ValueError("process_sets entry number %d is a duplicate: %s" % (i, ps))


def remove(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective); False if it was not registered.

    The global set cannot be removed (False). The set's communicator is freed
    and its id becomes free for the next ``add``.
    """
    with _lock:
        sid = process_set.process_set_id
        known = sid is not None and sid != 0 and _same(_sets.get(sid), process_set)
        # every rank calls it, agreed first (a communicator-built set may be a different
        # one per rank): called on some ranks only, the others' next process-set call
        # (add, remove) meets this one and both raise, instead of the sets' tables parting
        # ways (a later add raised on some ranks and blocked in Split on the others)
        note = "remove_process_set called"
        everyone = _comm().allgather(note)
        if any(m != note for m in everyone):
            raise ValueError(
                "matex process sets: remove_process_set is collective, every rank calls it: "
                "%s" % "; ".join("rank %d: %s" % (r, m if m == note else "another call")
                                 for r, m in enumerate(everyone)))
        if not known:
            return False
        registered = _sets.pop(sid)
        process_set._invalidate()
        registered._invalidate()
        if registered._group is not None:
            registered._group.release()
        return True


def get(process_set_id: int) -> ProcessSet:
    """The registered set with this id (0: the global set).

    Raises:
      ValueError: no such set is registered (as Horovod, for an unknown id).
    """
    if process_set_id == 0:
        return global_process_set
    with _lock:
        ps = _sets.get(process_set_id)
    if ps is None:
        raise ValueError("Process set %r does not exist or has not been registered"
                         % (process_set_id,))
    return ps


def _same(registered: Optional[ProcessSet], process_set: ProcessSet) -> bool:
    """Whether ``process_set`` is the registered set (or an object ``init`` mapped onto it)."""
    return registered is not None and (registered is process_set
                                       or registered.ranks == process_set.ranks)


def slot_of(process_set: Optional[ProcessSet]) -> int:
    """The communicator slot a collective on ``process_set`` names (0: the global set).

    Raises:
      ValueError: the set is not registered (or its id is not the one it was
        registered with).
      tf.errors.InvalidArgumentError: this rank is not a member (Horovod
        raises this error there too); only this rank raises, the members are
        not involved.
    """
    if process_set is None or process_set.process_set_id == 0:
        return 0
    ps = get(process_set.process_set_id) if process_set.process_set_id is not None else None
    if not _same(ps, process_set):
        raise ValueError("%s is not a registered process set: add it with "
                         "hvd.add_process_set() or hvd.init(process_sets=...)" % (process_set,))
    assert ps is not None
    if ps._group is None or not ps._group.member:
        import tensorflow as tf

        raise tf.errors.InvalidArgumentError(
            None, None, "rank %d is not a member of process set %d (ranks %s), so it cannot "
            "take part in its collectives; call them on the members only"
            % (_runtime.rank(), ps.process_set_id, ps.ranks))
    return ps._group.slot


def root_in(process_set: Optional[ProcessSet], root_rank: int) -> int:
    """``root_rank`` (a global rank, as Horovod takes it) as a rank of the set's communicator.

    Raises:
      ValueError: ``root_rank`` is not a member of the set.
    """
    if process_set is None or process_set.process_set_id == 0:
        return root_rank
    ranks = process_set.ranks or []
    if root_rank not in ranks:
        raise ValueError("root_rank %r is not a member of process set %d (ranks %s)"
                         % (root_rank, process_set.process_set_id, ranks))
    return ranks.index(root_rank)


def table() -> dict[int, list[int]]:
    """``{id: ranks}`` of every registered set, the global one (0) included."""
    with _lock:
        out = {0: list(range(_runtime.size()))}
        out.update({sid: list(ps.ranks or ()) for sid, ps in sorted(_sets.items())})
        return out


# ---- after a rank loss (ULFM) ------------------------------------------------

def _revoke_all() -> None:
    """Run first by the recovery: revoke the sets' communicators, so that a member
    blocked in one of them (waiting for a peer that went on to recover) fails too.
    Never raises: process sets do not stop a recovery."""
    with _lock:
        for ps in _sets.values():
            if ps._group is not None:
                ps._group.revoke()


def _rebuild_all(info: Any = None) -> None:
    """After a shrink: each set over its surviving members, in its old slot (collective
    over the survivors, who all run the listeners in the same order)."""
    with _lock:
        comm = _comm()
        world_to_new = dict(zip(_world_ranks(range(comm.Get_size()), comm),
                                range(comm.Get_size())))
        me = comm.Get_rank()
        if global_process_set.ranks:   # hvd.init set it: the global set's ranks now
            global_process_set.ranks = list(range(comm.Get_size()))
        for sid in sorted(_sets):
            ps = _sets[sid]
            ranks = sorted(world_to_new[w] for w in ps._world if w in world_to_new)
            ps.ranks = ranks
            ps._world = _world_ranks(ranks, comm)
            # a rank outside stays outside (membership only shrinks); a member's slot
            # stays, pointed at the survivors
            ps._group.rebuild(comm, 0 if me in ranks else None)
