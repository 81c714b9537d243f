"""Surviving rank failures: ULFM shrink-and-continue, the mechanics.

When a rank dies, collectives on the survivors fail with MPI_ERR_PROC_FAILED
or MPI_ERR_REVOKED — not necessarily on all of them, nor at the same
collective (ULFM errors are not uniform). ``recover()`` then runs on every
survivor: revoke the communicators (so every survivor leaves whatever
collective it is blocked in), shrink to the survivors, agree on the new
communicator, and install it (``_runtime._set_comm``) so every later
collective — TensorFlow ops included — uses it. What to do with the state
around it (restore, re-synchronise, check, re-divide the work) is the one
recovery loop's business: ``matex._recovery.run``.

Which errors mean a lost rank (``is_failure``): ``MPI_ERR_PROC_FAILED`` and
``MPI_ERR_REVOKED``, and under ULFM any other MPI error raised while a rank of
MaTEx's communicators is known failed or they are revoked. Open MPI's
nonblocking collectives (``coll/libnbc``: the agreement check's
``MPI_Iallreduce`` before every collective) report a failure they find while
starting a later round of their schedule as ``MPI_ERR_OTHER`` (Open MPI
5.0.11): seen on rank 0, the root of the binomial reduction, when a peer died
or a survivor revoked the communicator between two of its rounds; rank 0 then
died instead of recovering. Reproduced with plain mpi4py: rank 0 starts an
``Iallreduce`` and waits without progressing MPI while rank 1 sends its part
and revokes; rank 0's wait fails with class 16.

ULFM is active only under ``mpiexec --with-ft ulfm`` (``matexrun --ft``);
without it, agreement silently degrades to a plain allreduce, so ``mode()``
reports "none" and a failure ends the job (checkpoint/restart fallback:
``matexrun --restart``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback
from typing import Any, Callable, TypeVar

from matex import _config, _runtime, _state
from matex.errors import (MismatchError, RankFailure, _failure_classes, is_rank_failure,
                          mpi_error_class)

_listeners = _state.table("resilience.listeners", lifetime="process", factory=list)

launched_with_ft = _config.ft_requested
mode = _runtime.ft_mode


def is_failure(error) -> bool:
    """Whether ``error`` means a rank was lost, so the survivors should recover.

    ``MPI_ERR_PROC_FAILED``/``MPI_ERR_REVOKED`` (``errors.is_rank_failure``);
    under ULFM also an MPI error of any other class (a MaTEx op's payload or an
    ``MPI.Exception``), or a pickled payload that did not unpickle (a peer gone
    mid-transfer: ``UnpicklingError``, ``EOFError``), raised while one of MaTEx's
    communicators is revoked or has a rank known failed: Open MPI's nonblocking
    collectives report such a failure as ``MPI_ERR_OTHER`` when they find it
    starting a later round (see the module doc). An MPI error with no failure in
    sight stays an error.
    """
    if is_rank_failure(error):
        return True
    if mode() != "ulfm":
        return False
    if mpi_error_class(error) is None and not _is_torn_payload(error):
        return False
    return failure_known()


def _is_torn_payload(error) -> bool:
    """A pickled message that did not unpickle (``UnpicklingError``, ``EOFError``): under
    ULFM a peer that died mid-transfer can leave such a payload instead of an MPI error;
    it is a lost rank only when a failure is known (``is_failure``)."""
    import pickle

    return isinstance(error, (pickle.UnpicklingError, EOFError))


def failure_known() -> bool:
    """Whether a communicator MaTEx uses is revoked or has a rank known failed (local)."""
    from mpi4py import MPI

    for c in _runtime.communicators():
        if c == MPI.COMM_NULL:
            continue
        try:
            if c.Is_revoked():
                return True
            failed = c.Get_failed()
            try:
                if failed.Get_size() > 0:
                    return True
            finally:
                failed.Free()
        except (MPI.Exception, NotImplementedError):
            continue   # a freed or unusable communicator says nothing
    return False


class RankLoss:
    """What a recovery did: ranks lost (old numbering), sizes, times.

    ``started`` is when this survivor began recovering (``time.time()``),
    ``seconds`` the revoke/shrink/agree time, ``resync_seconds`` the time to
    re-synchronise state and re-divide the work (set by the recovery loop).
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


def describe_mode():
    """One line saying which fault-tolerance mode is active."""
    if mode() == "ulfm":
        return ("matex: fault tolerance: ULFM shrink-and-continue (a failed rank is "
                "dropped and training goes on)")
    if _config.checkpoint_dir():
        return ("matex: fault tolerance: checkpoint/restart (no ULFM): a failure ends the "
                "job; matexrun restarts it from the last checkpoint in %s"
                % _config.checkpoint_dir())
    return ("matex: fault tolerance: none (launched without --with-ft ulfm): a rank "
            "failure ends the job; use matexrun --ft, or matexrun --restart N")


_Listener = TypeVar("_Listener", bound=Callable[[Any], Any])


def on_rank_loss(function: _Listener) -> _Listener:
    """Call ``function(info)`` on every survivor after each recovery from lost ranks.

    ``info`` has ``lost`` (their ranks in the old communicator), ``old_size``,
    ``new_size`` and ``seconds`` (time to recover). Keras callbacks passed to
    ``fit`` may also define ``on_rank_loss(info)``. Returns ``function``, so it
    can be used as a decorator.
    """
    _listeners.append(function)
    return function


# run first by recover(); one raises when this job must not shrink and go on
_vetoes = _state.table("resilience.vetoes", lifetime="process", factory=list)


def add_recovery_veto(function):
    """Make ``recover()`` call ``function()`` first; it raises (e.g. ``RankFailure``) when
    the job cannot go on without the lost ranks (a model-parallel grid: their weights
    exist nowhere else). Returns ``function``."""
    _vetoes.append(function)
    return function


def remove_recovery_veto(function):
    if function in _vetoes:
        _vetoes.remove(function)


def veto_failure(exc):
    """Where no recovery loop runs (a ``fit`` whose model was compiled with an explicit
    ``DistributedOptimizer``), a rank failure still meets the vetoes: one of them raises
    its own error in place of ``exc``; otherwise this returns and the caller re-raises."""
    if _vetoes and mode() == "ulfm" and is_failure(exc):
        for veto in list(_vetoes):
            veto()


def recover():
    """Revoke, shrink and agree; install the survivors' communicator. Returns RankLoss.

    Listeners are not called here: the recovery loop calls ``notify`` once
    state is re-synchronised.
    """
    from mpi4py import MPI

    started = time.time()
    _dump_flight()
    for veto in list(_vetoes):
        veto()
    old = _runtime.comm()
    control = _runtime.control()
    old_size = old.Get_size()
    comm, new = old, None
    for attempt in range(5):
        for c in (comm, control):
            try:
                c.Revoke()
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
                if comm is not old:
                    comm.Free()
                comm = new   # shrink again, from the newer communicator
    lost = _lost_ranks(old, new)
    _runtime.end_lost_processes(_world_ranks(old, lost))
    if comm is not old:
        comm.Free()
    _runtime._set_comm(new)
    return RankLoss(lost, old_size, new.Get_size(), started, time.time() - started)


def uniformly(make, comm=None, attempts: int = 5, discard=None):
    """``make(c)``, a collective over ``c = comm()`` (default MaTEx's control
    communicator), with one outcome on every survivor: for collectives outside
    any recovery loop (start-up).

    Under ULFM a collective can succeed on some ranks and fail on others; an
    agreement on the outcome makes every survivor take the same branch, and
    after a failure they all recover (``recover``) and call ``make`` again on
    the survivors' communicator. ``discard(result)`` releases what ``make``
    made on a rank where it succeeded while another failed (e.g. a ``Dup``).
    Without ULFM it is ``make(c)``.
    """
    from mpi4py import MPI

    get = comm or _runtime.control
    if mode() != "ulfm":
        return make(get())
    for attempt in range(attempts):
        c, ok, result = get(), 1, None
        try:
            result = make(c)
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise
            ok = 0
        try:
            ok = c.Agree(ok)
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise
            ok = 0   # the agreement reports the failure alike on every survivor
        if ok:
            return result
        if result is not None and discard is not None:
            try:
                discard(result)
            except MPI.Exception:
                pass   # left unusable by the failure: nothing to release
        if attempt == attempts - 1:
            raise RankFailure("matex: ranks kept failing during start-up (%d attempts)"
                              % attempts)
        recover()


def _dump_flight():
    """Survivors dump their flight recorders before recovery replaces the communicator."""
    from matex import flight

    try:
        path = flight.dump("rank failure")
        sys.stderr.write("matex: flight recorder dumped to %s\n" % path)
    except OSError as exc:
        sys.stderr.write("matex: could not dump the flight recorder: %s\n" % exc)


def notify(info, callbacks=()):
    """Tell the ``on_rank_loss`` listeners and ``callbacks`` that define it.

    ``callbacks`` may be a list of Keras callbacks or Keras's ``CallbackList``.
    """
    for listener in list(_listeners):
        listener(info)
    for cb in getattr(callbacks, "callbacks", callbacks) or ():
        if hasattr(cb, "on_rank_loss"):
            cb.on_rank_loss(info)


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
    """Raise ``MismatchError`` on every rank unless all hold bitwise-identical ``arrays``."""
    mine = digest(arrays)
    everyone = _runtime.control().allgather(mine)
    if len(set(everyone)) != 1:
        raise MismatchError("replicas diverged after recovery: %s differs across ranks (%s)"
                            % (what, ", ".join("rank %d: %s" % (r, d[:12])
                                               for r, d in enumerate(everyone))))
    return mine


FAILED_LINE = "matex: rank %d of %d failed; the others continue without it"


def with_rank(rank: int, text: str) -> str:
    """``text`` with every line prefixed ``[rank N] `` (how a rank's own report is told
    apart in a job's merged stderr)."""
    return "".join("[rank %d] %s\n" % (rank, line) for line in text.splitlines())


def die_like_a_crash(text):
    """Print ``text`` prefixed by the rank, then end this rank as a crash would.

    Under ULFM a rank that fails must vanish the way a crashed rank does
    (SIGKILL): the survivors detect it and go on. Exiting with a status instead
    was seen to make the runtime end a later survivor; so only the last rank
    (alone in its communicator) exits with status 1. Under ULFM, ``mpiexec``
    exits 0 even when every rank was killed; so the rank first leaves a report
    in ``matexrun --ft``'s status directory (``matex._status``), which
    matexrun counts to report that case as a failure. ``FAILED_LINE`` is for
    people reading stderr; nothing parses it.
    """
    import signal

    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    sys.stderr.write(with_rank(rank, text))
    sys.stderr.write(with_rank(rank, FAILED_LINE % (rank, size)))
    sys.stderr.flush()
    sys.stdout.flush()
    try:
        from matex import _status

        _status.report_failure(rank, text)
    except Exception:  # noqa: BLE001 - a rank that cannot report must still die
        pass
    if _runtime.started() and _runtime.comm().Get_size() == 1:
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


# how long a rank ending on an error waits for its peers to end too before it aborts the job
LEAVE_TOGETHER_S = 2.0


def end_job(text: str) -> None:
    """End this rank on an error it raised, ``text`` being its traceback, never leaving a
    peer to hang.

    Under ULFM the rank vanishes as a crash would (``die_like_a_crash``) and the
    survivors go on. Otherwise ``text`` goes to stderr, prefixed with the rank
    when the job has several; then, if every rank reaches this within
    ``LEAVE_TOGETHER_S`` (they all raised: an error agreed on every rank), this
    returns and the process ends normally; if not, some peer waits in MPI for
    this rank (a collective of the step it left), and the whole job is aborted
    (``MPI_Abort``) instead of hanging. Open MPI's ``MPI_Finalize`` waits for
    every rank, so a rank that simply exited would hang too.
    """
    if mode() == "ulfm":
        die_like_a_crash(text)
    size = _config.launched_size() or 1
    if size > 1:
        text = with_rank(_config.launched_rank(), text)
    sys.stderr.write(text)
    sys.stderr.flush()
    leave_or_abort(1, unknown="abort")


def leave_or_abort(code: int, unknown: str = "leave") -> None:
    """Return when every rank of the job reaches this within ``LEAVE_TOGETHER_S`` (they
    all end: an error or exit status agreed on every rank), or when the job has one rank
    or MPI is not running; otherwise abort the whole job with ``code``: some peer still
    waits in MPI for this rank, which is ending with an error or a non-zero status
    (without ULFM). Open MPI's launcher ends a job whose rank exits non-zero anyway, but
    only after that rank's ``MPI_Finalize``, which waits for every rank.

    ``unknown``: what to do when MaTEx never started (no communicator to meet on):
    ``"abort"`` (an uncaught error) or ``"leave"`` (an exit status)."""
    sys.stdout.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if ((_config.launched_size() or 1) < 2 or mpi is None or not mpi.Is_initialized()
            or mpi.Is_finalized()):
        return
    together = _runtime.leave_together(LEAVE_TOGETHER_S)
    if together is False or (together is None and unknown == "abort"):
        mpi.COMM_WORLD.Abort(code)


def install_excepthook(ulfm: bool = False) -> None:
    """An uncaught exception ends the job through ``end_job`` instead of leaving the other
    ranks waiting in a collective for ever.

    Without ULFM (``import matex``): in a job of several ranks, unless the script set
    its own hook first or the session is interactive. ``ulfm=True`` (the Keras patch
    under ULFM): its rank alone ends, as a crash would. Without the hook a ULFM rank
    that raises just exits (``MPI_Finalize`` is skipped there), which the survivors
    also recover from.
    """
    if ulfm:
        if mode() != "ulfm":
            return
    elif (hasattr(sys, "ps1") or sys.flags.interactive or _config.ft_requested()
          or (_config.launched_size() or 1) < 2 or sys.excepthook is not sys.__excepthook__):
        return

    def hook(kind, value, tb):
        end_job("".join(traceback.format_exception(kind, value, tb)))

    sys.excepthook = hook
