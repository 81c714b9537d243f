"""Process-wide MaTEx state: the MPI communicators in use.

The communicator is state, not a constant: ``_set_comm`` replaces it (the
resilience layer swaps in a shrunk one), frees the ones it replaces, and
every reader, Python or C++, asks for the current one at the time of use.

Two communicators over the same ranks are kept apart:

* ``comm()``: the data communicator, used by the collective ops (C++);
* ``control()``: a duplicate for MaTEx's own Python-level traffic
  (agreement, digests, seeds, file broadcasts), so that control messages can
  never match a data collective issued by another thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from matex import _config, _state

if TYPE_CHECKING:
    from mpi4py import MPI

_lock = threading.RLock()


_F = TypeVar("_F", bound=Callable[..., Any])


def _run_as_is(function: _F) -> _F:
    """Mark ``function`` so TensorFlow's AutoGraph calls it unconverted.

    It is plain Python that creates ops (or none): converting it, and all it
    calls on first use (loading, building), only yields warnings. This is the
    mark ``tf.autograph.experimental.do_not_convert`` sets, without its
    per-call wrapper (eager collectives are on the hot path).
    """
    function.autograph_info__ = frozenset()
    return function


_now = _state.namespace(
    "runtime",
    comm=None,        # mpi4py communicator every collective uses
    control=None,     # duplicate of comm for MaTEx's Python-level messages
    local=None,       # ranks of comm sharing this node
    owned=False,      # whether MaTEx created comm (then it frees it when replaced)
    cross=None,       # (cross rank, cross size, homogeneous) of comm, computed with it
    farewell=None,    # duplicate of MPI_COMM_WORLD for leave_together() alone (no ULFM)
    control_class=None,   # while matex.hpo searches: the class of new control communicators
    peers=None,       # world rank -> (hostname, pid) of the ranks alive at start-up (ULFM)
    pointed=False,    # whether the core was handed the communicators (by _core)
)

PROGRESS_INTERVAL = 0.05   # seconds between a background thread's entries into MPI


def ft_mode():
    """"ulfm" when launched with ULFM fault tolerance, else "none"."""
    if not _config.ft_requested():
        return "none"   # without initialising MPI
    from mpi4py import MPI

    return "ulfm" if hasattr(MPI.Comm, "Shrink") else "none"


@_run_as_is
def init(comm: MPI.Intracomm | None = None) -> None:
    """Start MaTEx on ``comm`` (default: a duplicate of ``MPI.COMM_WORLD``).

    Idempotent: later calls without ``comm`` do nothing. Every public function
    calls it implicitly, so calling it yourself is optional. Starting is
    collective over ``MPI.COMM_WORLD``: if some rank does not arrive within
    ``MATEX_START_TIMEOUT`` seconds, the ranks that did raise an error instead
    of hanging.
    """
    with _lock:
        if _now.comm is not None and comm is None:
            return
        from mpi4py import MPI

        _require_thread_multiple(MPI)
        if comm is not None:
            _set_comm(comm, owned=False)
        elif ft_mode() == "ulfm":
            _start_ulfm()
        else:
            MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
            _wait_for_every_rank(MPI.COMM_WORLD)
            _set_comm(MPI.COMM_WORLD.Dup())
            if _now.farewell is None:
                _now.farewell = MPI.COMM_WORLD.Dup()
        from matex import _cpu

        _cpu.size_pools(_now.local)   # before TensorFlow makes its thread pools


def leave_together(timeout: float) -> bool | None:
    """Whether every rank of the job reaches this call within ``timeout`` seconds.

    For a rank ending on an uncaught error (``_resilience.end_job``): when every
    rank raised (an error agreed on every rank), they may all end normally;
    otherwise some peer is still waiting in MPI for this rank, and the job must
    be aborted. A non-blocking barrier on a communicator used for nothing else,
    so it can never match a collective a peer is blocked in. None when MaTEx
    did not start on ``MPI_COMM_WORLD`` itself (no such communicator: unknown).
    """
    comm = _now.farewell
    if comm is None:
        return None
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


_THREAD_LEVELS = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")


def _require_thread_multiple(MPI):
    """Raise unless MPI runs at ``MPI_THREAD_MULTIPLE``, naming the fix.

    MaTEx's own threads enter MPI concurrently: TensorFlow's inter-op threads
    run the collectives, a progress thread drives non-blocking requests and
    ULFM's heartbeats, the control communicator serves the main thread. At a
    lower level that is undefined behaviour in MPI (crashes, corrupted
    messages), so it is an error rather than a warning.
    """
    provided = MPI.Query_thread()
    if provided >= MPI.THREAD_MULTIPLE:
        return
    names = {getattr(MPI, "THREAD_" + n): "MPI_THREAD_" + n for n in _THREAD_LEVELS}
    raise RuntimeError(
        "matex: MPI provides %s, but MaTEx's threads (TensorFlow's collective ops, its "
        "progress thread) call MPI concurrently and need MPI_THREAD_MULTIPLE. Fix: on Cray "
        "MPICH set MPICH_MAX_THREAD_SAFETY=multiple; with mpi4py, do not lower "
        "mpi4py.rc.thread_level (its default asks for 'multiple'); otherwise use an MPI built "
        "with thread support (Open MPI 5 and MPICH 4 are)."
        % names.get(provided, "thread level %d" % provided))


def _wait_for_every_rank(world, tolerate=()):
    """Return once every rank of ``world`` has called this; raise after the start timeout.

    A non-blocking barrier, polled: ranks that are late by a few seconds
    (reading data, building) are waited for; a rank that never comes (the
    script started MaTEx on some ranks only) turns into a clear error on the
    ranks that did, instead of a hang in the first collective.
    ``tolerate``: MPI error classes that end the wait quietly (ULFM: a rank
    died before it arrived; the shrink that follows drops it).
    """
    from mpi4py import MPI

    timeout = _config.start_timeout()
    try:
        request = world.Ibarrier()
        deadline, pause = time.monotonic() + timeout, 0.0005
        while not request.Test():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "matex: rank %d waited %.0f s for the other ranks to start MaTEx "
                    "(MATEX_START_TIMEOUT). Starting is collective: `import matex.keras`, "
                    "matex.init() and the first MaTEx call must run on every rank, not "
                    "inside code that only some ranks execute (e.g. `if rank == 0:`)."
                    % (world.Get_rank(), timeout))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
    except MPI.Exception as exc:
        if exc.Get_error_class() not in tolerate:
            raise


def keep_progressing():
    """Under ULFM, keep MPI's progress engine turning from a background thread.

    The launcher runs the heartbeat failure detector without its own thread
    (that thread can crash a peer still in ``MPI_Init``); heartbeats then
    flow only while some thread is inside MPI, which this thread ensures
    during long computation. Initialises MPI. Idempotent.
    """
    import atexit

    from matex import _native

    core = _native.core()
    if not core.progress_thread_running():
        core.start_progress_thread(PROGRESS_INTERVAL)
        atexit.register(core.stop_progress_thread)


def _start_ulfm():
    """Under ULFM: begin on the ranks alive at start-up and install their communicator.

    The communicator is a shrink of ``MPI_COMM_WORLD`` rather than a duplicate:
    a rank that died (or was declared dead by the failure detector) before
    training began is dropped here, uniformly on every survivor, instead of
    failing the first collective. Also records every survivor's host and pid.
    """
    import socket

    from mpi4py import MPI

    from matex import _faults
    from matex.errors import _failure_classes

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    keep_progressing()
    _faults.maybe_fail(0, "start")
    failures = _failure_classes()
    _wait_for_every_rank(world, tolerate=failures)
    me = (world.Get_rank(), socket.gethostname(), os.getpid())
    try:   # every launched rank, to end lost ones that still run on this host
        _now.peers = {r: (host, pid) for r, host, pid in world.allgather(me)}
    except MPI.Exception as exc:
        if exc.Get_error_class() not in failures:
            raise
    for attempt in range(5):
        # A rank that ends right after its own start (a script that fails or
        # finishes at once) can fail a peer's last start-up collective: shrink
        # again, as recovery does, instead of failing the survivor.
        try:
            _set_comm(world.Shrink())
            alive = {r: (host, pid) for r, host, pid in _now.control.allgather(me)}
            break
        except MPI.Exception as exc:
            if exc.Get_error_class() not in failures or attempt == 4:
                raise
    _now.peers = _now.peers or alive
    lost = sorted(set(range(world.Get_size())) - set(alive))
    if lost:
        end_lost_processes(lost)
        if _now.comm.Get_rank() == 0:
            sys.stderr.write("matex: rank(s) %s failed during start-up; %d rank(s) go on\n"
                             % (", ".join(map(str, lost)), _now.comm.Get_size()))
            sys.stderr.flush()


def end_lost_processes(world_ranks):
    """SIGKILL lost ranks still alive on this host (a hung rank keeps mpiexec waiting)."""
    import signal
    import socket

    if _now.peers is None:
        return
    here = socket.gethostname()
    for rank in world_ranks:
        host, pid = _now.peers.get(rank, (None, None))
        if host == here and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass   # already gone


def _cross_figures_of(comm, local) -> tuple[int, int, bool]:
    """``(cross rank, cross size, homogeneous)`` of ``comm`` whose node-local part is
    ``local`` (collective over ``comm``)."""
    cross = comm.Split(local.Get_rank(), comm.Get_rank())
    try:
        sizes = comm.allgather(local.Get_size())
        return cross.Get_rank(), cross.Get_size(), len(set(sizes)) == 1
    finally:
        cross.Free()


def _set_comm(comm, owned=True):
    """Make ``comm`` the communicator of every later collective (collective call).

    The communicators it replaces are freed (the data communicator only if
    MaTEx created it: one the script passed to ``init`` stays the script's).
    Freeing is local in MPI, so it is safe on a revoked communicator.
    """
    from mpi4py import MPI

    with _lock:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        # Horovod's cross figures, collectively now, so reading them later is local (a
        # rank that alone asks for hvd.cross_size() must not start a collective)
        _now.cross = _cross_figures_of(comm, local)
        control = comm.Dup()
        control.Set_errhandler(MPI.ERRORS_RETURN)
        if _now.control_class is not None:
            control = _now.control_class(control)   # the same handle, with checked collectives
        old = (_now.comm, _now.control, _now.local, _now.owned)
        _now.comm, _now.control, _now.local, _now.owned = comm, control, local, owned
        from matex import _native

        core = _native.loaded()
        if core is not None:
            core.set_communicator(MPI._handleof(comm))
        old_comm, old_control, old_local, old_owned = old
        for c in (old_local, old_control) + ((old_comm,) if old_owned else ()):
            if c is not None and c != MPI.COMM_NULL:
                try:
                    c.Free()
                except MPI.Exception:
                    pass   # a communicator the failure left unusable: nothing to release


def communicators() -> list:
    """Every communicator MaTEx uses now (data, control, slots), without initialising MPI."""
    with _lock:
        return [c for c in [_now.comm, _now.control] + list(_slots.values()) if c is not None]


def _core():
    """The pybind11 core, pointed at the current communicator."""
    from mpi4py import MPI

    from matex import _native
    init()
    module = _native.core()
    if not _now.pointed:
        # once per process, whoever loaded the module first: the readers load the op
        # library (and with it the core) for their tf.data op without any communicator
        with _lock:
            module.set_communicator(MPI._handleof(_now.comm))
            for slot, sub in _slots.items():
                module.set_communicator_slot(slot, MPI._handleof(sub))
            _now.pointed = True
    while _core_hooks:
        _core_hooks.pop(0)(module)
    return module


# ---- sub-communicators in numbered slots -------------------------------------
#
# An op names its communicator by slot (its ``comm`` argument): slot 0 is
# ``comm()``; a grid's pipeline and tensor-parallel groups get slots of their
# own. The slot number is what a traced function captures, never a handle, so
# replacing a slot's communicator (after a failure) needs no retrace.

_slots = _state.table("runtime.slots", lifetime="process")   # slot (>= 1) -> mpi4py communicator
_MAX_SLOTS = 64   # kMaxCommSlots in tf_ops/core/matex_core.h


def _publish_slot(slot, sub):
    from mpi4py import MPI

    from matex import _native

    core = _native.loaded()
    if core is not None:
        core.set_communicator_slot(slot, 0 if sub is None else MPI._handleof(sub))


def register_comm(sub):
    """Give the mpi4py communicator ``sub`` a slot that ops can name; return the slot.

    The communicator stays the caller's (MaTEx never frees it); release the
    slot with ``release_comm`` before freeing it.
    """
    from mpi4py import MPI

    init()
    sub.Set_errhandler(MPI.ERRORS_RETURN)
    with _lock:
        free = [s for s in range(1, _MAX_SLOTS) if s not in _slots]
        if not free:
            raise RuntimeError("all %d communicator slots are in use; release_comm() "
                               "the sub-communicators no longer needed" % (_MAX_SLOTS - 1))
        slot = free[0]
        _slots[slot] = sub
        _publish_slot(slot, sub)
    return slot


def replace_comm(slot, sub):
    """Point ``slot`` at ``sub`` (e.g. a shrunk communicator); later ops use it."""
    with _lock:
        if slot not in _slots:
            raise KeyError("communicator slot %d is not registered" % slot)
        _slots[slot] = sub
        _publish_slot(slot, sub)


def release_comm(slot):
    """Forget ``slot``: an op naming it later fails with a clear error."""
    with _lock:
        if _slots.pop(slot, None) is not None:
            _publish_slot(slot, None)


def slot_comm(slot):
    """The mpi4py communicator in ``slot`` (0: ``comm()``)."""
    if slot == 0:
        return comm()
    with _lock:
        try:
            return _slots[slot]
        except KeyError:
            raise KeyError("communicator slot %d is not registered" % slot) from None


_core_hooks = _state.table("runtime.core_hooks", lifetime="process", factory=list)
# run once each, with the core, at its first use through _core()


def on_core_ready(hook):
    """Run ``hook(core)`` when the core is first used (or now, if it already was).

    Higher layers (the flight recorder's watchdog, the timeline) register here,
    so that this module imports none of them.
    """
    from matex import _native

    if _now.pointed:
        hook(_native.loaded())
    else:
        _core_hooks.append(hook)


def started() -> bool:
    """Whether MaTEx holds a communicator (``init`` ran), without starting MPI."""
    return _now.comm is not None


def set_control_class(cls: Callable | None) -> None:
    """Wrap every control communicator made from now on in ``cls`` (None: plain).

    ``matex.hpo`` sets it while a search runs, so that its trials' control
    traffic is checked; the communicator in use keeps its class until replaced.
    """
    _now.control_class = cls


@_run_as_is
def comm() -> MPI.Intracomm:
    """The mpi4py communicator MaTEx currently uses (it may be replaced after a failure)."""
    init()
    return _now.comm


def control():
    """The duplicate of ``comm()`` for MaTEx's own Python-level messages."""
    init()
    return _now.control


@_run_as_is
def rank() -> int:
    """This process's rank in the current communicator."""
    return comm().Get_rank()


@_run_as_is
def size() -> int:
    """Number of ranks in the current communicator."""
    return comm().Get_size()


@_run_as_is
def local_rank() -> int:
    """This process's rank among the ranks on the same node."""
    init()
    return _now.local.Get_rank()


@_run_as_is
def local_size() -> int:
    """Number of ranks on this node."""
    init()
    return _now.local.Get_size()


def cross_figures() -> tuple[int, int, bool]:
    """``(cross rank, cross size, homogeneous)`` of the communicator in use: this rank's
    index among the ranks of its local rank across nodes, their number, and whether every
    node runs as many ranks. Computed when the communicator was set; a local read."""
    init()
    return _now.cross
