"""Surviving rank failures: ULFM shrink-and-continue.

When a rank dies, collectives on the survivors fail with MPI_ERR_PROC_FAILED
or MPI_ERR_REVOKED — not necessarily on all of them, nor at the same
collective (ULFM errors are not uniform). ``recover()`` then runs on every
survivor: revoke the communicator (so every survivor leaves whatever
collective it is blocked in), shrink it to the survivors, agree on the new
communicator, and install it (``_runtime._set_comm``) so every later
collective — TensorFlow ops included — uses it. Callers (``_keras_patch`` for
``fit``) then re-synchronise state from the new rank 0, check replica digests,
and re-divide the remaining work.

ULFM is active only under ``mpiexec --with-ft ulfm`` (``matexrun --ft``);
without it, agreement silently degrades to a plain allreduce, so ``mode()``
reports "none" and a failure ends the job (checkpoint/restart fallback:
``matexrun --restart``).
"""

import hashlib
import os
import sys
import time
import traceback

from matex import _runtime

_listeners = []
_peers = None   # world rank -> (hostname, pid) of the ranks alive at start-up (ULFM)


class RankLoss:
    """What a recovery did: ranks lost (old numbering), sizes, times.

    ``started`` is when this survivor began recovering (``time.time()``),
    ``seconds`` the revoke/shrink/agree time, ``resync_seconds`` the time to
    re-synchronise state and re-divide the work (set by the caller).
    """

    def __init__(self, lost, old_size, new_size, started, seconds):
        self.lost = lost
        self.old_size = old_size
        self.new_size = new_size
        self.started = started
        self.seconds = seconds
        self.resync_seconds = 0.0

    def __repr__(self):
        return "RankLoss(lost=%s, size %d -> %d, %.3f s + %.3f s resync)" % (
            self.lost, self.old_size, self.new_size, self.seconds, self.resync_seconds)


def launched_with_ft():
    """Whether the launcher asked for ULFM (``mpiexec --with-ft ulfm``); no MPI needed."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")


def mode():
    """"ulfm" when launched with ULFM fault tolerance, else "none"."""
    if not launched_with_ft():
        return "none"   # without initialising MPI
    from mpi4py import MPI

    return "ulfm" if hasattr(MPI.Comm, "Shrink") else "none"


def describe_mode():
    """One line saying which fault-tolerance mode is active."""
    if mode() == "ulfm":
        return ("matex: fault tolerance: ULFM shrink-and-continue (a failed rank is "
                "dropped and training goes on)")
    if os.environ.get("MATEX_CHECKPOINT_DIR"):
        return ("matex: fault tolerance: checkpoint/restart (no ULFM): a failure ends the "
                "job; matexrun restarts it from the last checkpoint in %s"
                % os.environ["MATEX_CHECKPOINT_DIR"])
    return ("matex: fault tolerance: none (launched without --with-ft ulfm): a rank "
            "failure ends the job; use matexrun --ft, or matexrun --restart N")


def _failure_classes():
    from mpi4py import MPI

    return {c for c in (getattr(MPI, "ERR_PROC_FAILED", None),
                        getattr(MPI, "ERR_PROC_FAILED_PENDING", None),
                        getattr(MPI, "ERR_REVOKED", None)) if c is not None}


def is_failure(exc):
    """Whether ``exc`` reports a failed peer or a revoked communicator."""
    from mpi4py import MPI

    if isinstance(exc, MPI.Exception):
        return exc.Get_error_class() in _failure_classes()
    from matex._collectives import mpi_error_class

    return mpi_error_class(exc) in _failure_classes()


PROGRESS_INTERVAL = 0.05   # seconds between a background thread's entries into MPI


def keep_progressing():
    """Under ULFM, keep MPI's progress engine turning from a background thread.

    ``launch.ft_mpi_args`` runs the heartbeat failure detector without its own
    thread (that thread can crash a peer still in ``MPI_Init``); heartbeats
    then flow only while some thread is inside MPI, which this thread
    ensures during long computation. Initialises MPI. Idempotent.
    """
    import atexit

    from matex import _native

    core = _native.core()
    if not core.progress_thread_running():
        core.start_progress_thread(PROGRESS_INTERVAL)
        atexit.register(core.stop_progress_thread)


def start():
    """Under ULFM: begin on the ranks alive at start-up and install their communicator.

    The communicator is a shrink of ``MPI_COMM_WORLD`` rather than a duplicate:
    a rank that died (or was declared dead by the failure detector) before
    training began is dropped here, uniformly on every survivor, instead of
    failing the first collective. Also records every survivor's host and pid.
    """
    global _peers
    import socket

    from mpi4py import MPI

    from matex import _faults

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    keep_progressing()
    _faults.maybe_fail(0, "start")
    me = (world.Get_rank(), socket.gethostname(), os.getpid())
    try:   # every launched rank, to end lost ones that still run on this host
        _peers = {r: (host, pid) for r, host, pid in world.allgather(me)}
    except MPI.Exception as exc:
        if exc.Get_error_class() not in _failure_classes():
            raise
    comm = world.Shrink()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    _runtime._set_comm(comm)
    alive = {r: (host, pid) for r, host, pid in comm.allgather(me)}
    _peers = _peers or alive
    lost = sorted(set(range(world.Get_size())) - set(alive))
    if lost:
        _end_lost_processes(lost)
        if comm.Get_rank() == 0:
            sys.stderr.write("matex: rank(s) %s failed during start-up; %d rank(s) go on\n"
                             % (", ".join(map(str, lost)), comm.Get_size()))
            sys.stderr.flush()


def _end_lost_processes(world_ranks):
    """SIGKILL lost ranks still alive on this host (a hung rank keeps mpiexec waiting)."""
    import signal
    import socket

    if _peers is None:
        return
    here = socket.gethostname()
    for rank in world_ranks:
        host, pid = _peers.get(rank, (None, None))
        if host == here and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass   # already gone


def on_rank_loss(function):
    """Call ``function(info)`` on every survivor after each recovery from lost ranks.

    ``info`` has ``lost`` (their ranks in the old communicator), ``old_size``,
    ``new_size`` and ``seconds`` (time to recover). Keras callbacks passed to
    ``fit`` may also define ``on_rank_loss(info)``. Returns ``function``, so it
    can be used as a decorator.
    """
    _listeners.append(function)
    return function


def recover():
    """Revoke, shrink and agree; install the survivors' communicator. Returns RankLoss.

    Listeners are not called here: the caller calls ``notify`` once state is
    re-synchronised.
    """
    from mpi4py import MPI

    started = time.time()
    old = _runtime.comm()
    old_size = old.Get_size()
    comm, new = old, None
    for attempt in range(5):
        try:
            comm.Revoke()
        except MPI.Exception:
            pass   # already revoked by another survivor
        try:
            new = comm.Shrink()
            new.Set_errhandler(MPI.ERRORS_RETURN)
            new.Agree(1)   # fails if a member of `new` died meanwhile
            break
        except MPI.Exception as exc:
            if exc.Get_error_class() not in _failure_classes() or attempt == 4:
                raise
            if new is not None:
                comm = new   # shrink again, from the newer communicator
    lost = _lost_ranks(old, new)
    _end_lost_processes(_world_ranks(old, lost))
    _runtime._set_comm(new)
    return RankLoss(lost, old_size, new.Get_size(), started, time.time() - started)


def notify(info):
    """Tell the ``on_rank_loss`` listeners (once the survivors are back in step)."""
    for listener in list(_listeners):
        listener(info)


def _lost_ranks(old, new):
    from mpi4py import MPI

    old_group, new_group = old.Get_group(), new.Get_group()
    kept = set(MPI.Group.Translate_ranks(new_group, list(range(new.Get_size())), old_group))
    return [r for r in range(old.Get_size()) if r not in kept]


def _world_ranks(comm, ranks):
    from mpi4py import MPI

    return MPI.Group.Translate_ranks(comm.Get_group(), ranks, MPI.COMM_WORLD.Get_group())


def digest(arrays):
    """SHA-256 of the bytes of ``arrays`` (NumPy), in order."""
    import numpy as np

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check_replicas(arrays, what="model and optimizer state"):
    """Raise on every rank unless all ranks hold bitwise-identical ``arrays``."""
    mine = digest(arrays)
    everyone = _runtime.comm().allgather(mine)
    if len(set(everyone)) != 1:
        raise RuntimeError("replicas diverged after recovery: %s differs across ranks (%s)"
                           % (what, ", ".join("rank %d: %s" % (r, d[:12])
                                              for r, d in enumerate(everyone))))
    return mine


FAILED_LINE = "matex: rank %d of %d failed; the others continue without it"


def die_like_a_crash(text):
    """Print ``text`` prefixed by the rank, then end this rank as a crash would.

    Under ULFM a rank that fails must vanish the way a crashed rank does
    (SIGKILL): the survivors detect it and go on. Exiting with a status instead
    was seen to make the runtime end a later survivor; so only the last rank
    (alone in its communicator) exits with status 1. Under ULFM, ``mpiexec``
    exits 0 even when every rank was killed; ``matexrun`` counts the
    ``FAILED_LINE`` messages to report that case as a failure.
    """
    import signal

    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    sys.stderr.write("".join("[rank %d] %s\n" % (rank, line) for line in text.splitlines()))
    sys.stderr.write("[rank %d] %s\n" % (rank, FAILED_LINE % (rank, size)))
    sys.stderr.flush()
    sys.stdout.flush()
    if _runtime._comm is not None and _runtime._comm.Get_size() == 1:
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def install_excepthook():
    """Under ULFM, an uncaught exception ends only its rank, as a crash would."""
    def hook(kind, value, tb):
        die_like_a_crash("".join(traceback.format_exception(kind, value, tb)))

    sys.excepthook = hook


def run_resilient(step, num_steps, variables, optimizer, undo_on_redo=()):
    """Run a custom training loop that survives rank failures (under ULFM).

    Calls ``step(i)`` for every step ``i`` not yet committed, up to
    ``num_steps``. After a rank failure the survivors recover, take every
    variable in ``variables`` (model and optimizer state) from the new rank 0,
    check that replicas agree, and go on from the first step the new rank 0 had
    not applied. Requirements on ``step``: it updates through a
    ``DistributedOptimizer`` (whose update is all-or-nothing and advances
    ``optimizer.iterations``, the commit counter), and derives its data from
    ``i``, ``matex.rank()`` and ``matex.size()`` when called, so a redone step
    is re-divided among the survivors. ``undo_on_redo``: variables a step
    changes before its update (e.g. counters, BatchNorm statistics), restored
    when that step has to be redone. Without ULFM a failure is raised.

    Returns the number of recoveries.
    """
    from matex import _collectives

    recoveries = 0
    done = int(optimizer.iterations)
    while done < num_steps:
        saved = [v.numpy() for v in undo_on_redo]
        try:
            step(done)
            done = int(optimizer.iterations)
        except Exception as exc:  # noqa: BLE001 - classified right below
            if mode() != "ulfm" or not is_failure(exc):
                raise
            info = recover()
            resync_started = time.time()
            if int(optimizer.iterations) == done:   # this rank did not apply the step
                for v, value in zip(undo_on_redo, saved):
                    v.assign(value)
            _collectives.broadcast_variables(list(variables), 0)
            done = _runtime.comm().bcast(int(optimizer.iterations), root=0)
            check_replicas([v.numpy() for v in variables])
            info.resync_seconds = time.time() - resync_started
            notify(info)
            recoveries += 1
    return recoveries
