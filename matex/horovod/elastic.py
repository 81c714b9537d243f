"""Horovod's elastic API (``hvd.elastic``) on MaTEx's recovery loop.

    state = hvd.elastic.ObjectState(batch=0)          # or TensorFlowKerasState(model, ...)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, steps):
            step(state.batch)
            state.commit()

    train(state)

``run(func)`` calls ``func(state)`` inside ``matex._recovery.run`` (the one
recovery loop ``fit`` and ``run_resilient`` use): when a rank is lost under
ULFM (``matexrun --ft``), the survivors shrink the communicator, every
survivor ``restore()``s its state to its last ``commit()``, ``reset``
callbacks run, the state is ``sync()``ed from the lowest rank holding the
most commits (Horovod takes rank 0's; a survivor whose last step's collective
failed may be one commit behind another), the survivors' copies are checked
bitwise equal, and ``func`` is called again with ``hvd.size()`` and
``hvd.rank()`` already the survivors'.

A whole host lost with its Open MPI daemon ends the job instead (ULFM cannot
go on: open-mpi/ompi #13215). Under ``matexrun --ft --elastic`` each commit
is then also written to disk (``write_through``): rank 0 pickles the
committed state to ``MATEX_CHECKPOINT_DIR/elastic-<func>.pkl`` (a temporary
file renamed into place: never half-written), every
``MATEX_ELASTIC_WRITE_EVERY`` commits (default 1), and matexrun restarts the
job on the hosts its discovery script names; there ``run`` starts from that
file (rank 0 reads it, ``sync`` gives it to the others). The file is removed
when ``func`` returns. Its cost is one pickle of the state per commit on rank
0 (model, optimizer and objects: a copy to host memory that ``commit``
makes anyway, then a write): commit less often than every step when the model
is large.

Differences from Horovod: no host is ever added to a running job, so
``check_host_updates`` has nothing to report (``HostsUpdatedInterrupt`` is
never raised); a new host joins at the next restart.
"""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any, Callable, TypeVar

import numpy as np

from matex import _atomic, _config, _faults, _recovery, _runtime, _state
from matex._everywhere import on_every_rank

WRITE_EVERY_VAR = _config.ELASTIC_WRITE_EVERY_VAR

F = TypeVar("F", bound=Callable[..., Any])


def _broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    from matex._objects import broadcast_object

    return broadcast_object(obj, root_rank)


class State:
    """State kept consistent across rank failures by ``run``: commit, restore, sync.

    Args:
      bcast_object: broadcasts a picklable object (``bcast_object(obj,
        root_rank=r)``); default ``matex.broadcast_object``.
      get_rank: returns this rank; default ``matex.rank``.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or _broadcast_object
        self._rank = get_rank or _runtime.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0    # commits made (or synchronised from the root)
        self._root = 0       # the rank ``sync`` takes values from (set by ``run``)
        self._file: str | None = None   # where commits are written through (set by ``run``)

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Call each of ``callbacks`` after every recovery (e.g. to rescale a learning rate
        by the new ``hvd.size()``), before the state is synchronised."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """``reset()`` then the reset callbacks (called by ``run`` after a recovery)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Horovod's host notifications; MaTEx sends none (see ``check_host_updates``)."""

    def commit(self) -> None:
        """Save the state as the point to restore to after a failure (local, cheap: a copy
        in host memory); under ``matexrun --elastic`` also written to disk on rank 0."""
        self.save()
        self._commits += 1
        self._write_through()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Nothing to check on MaTEx: a running job never gains hosts, and a lost host is
        a rank failure (recovered by ``run``, or a restart by ``matexrun --elastic``)."""

    def save(self) -> None:
        """Copy the state to host memory (the commit)."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Put back the last committed state, undoing uncommitted changes (local)."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Take the root rank's state (collective)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called after a recovery, before ``sync``."""

    # -- what MaTEx adds: the committed state as data (disk), and as arrays (digest)
    def committed(self) -> Any:
        """The last committed state as picklable data (written to disk)."""
        raise NotImplementedError()

    def load_committed(self, data: Any) -> None:
        """Make ``data`` (from ``committed``) the last commit, then ``restore`` it."""
        raise NotImplementedError()

    def arrays(self) -> list[np.ndarray]:
        """The synchronised state as arrays, equal bitwise on every rank after ``sync``."""
        return [np.frombuffer(pickle.dumps(self.committed()), np.uint8)]

    def disk_extras(self) -> Any:
        """What a commit written to disk holds beyond ``committed()``, agreed over the
        ranks (collective: every rank calls it); None: nothing."""
        return None

    def load_disk_extras(self, data: Any) -> None:
        """Put back ``disk_extras``'s data (on the rank resuming from disk)."""

    def _write_through(self) -> None:
        """Rank 0 writes the commit to ``_file`` (every ``MATEX_ELASTIC_WRITE_EVERY``-th);
        collective then, so that a failed write is an error on every rank."""
        path = self._file
        if path is None or self._commits % _write_every():
            return

        extras = self.disk_extras()   # on every rank: it may take a collective

        def write():
            if self._rank() != 0:
                return
            data = {"commits": self._commits, "state": self.committed()}
            if extras is not None:   # the optimizer's step states (the accumulation)
                data["extras"] = extras
            _atomic.write(path, pickle.dumps(data), mkdir=True)

        on_every_rank(_runtime.control(), write, what="hvd.elastic: writing the commit to %s"
                      % path)


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments (attributes).

    ``ObjectState(epoch=0, batch=0)``: ``state.epoch`` and ``state.batch`` are
    committed, restored and synchronised.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = (self._bcast_object(self._saved_state) if self._root == 0 else
                                 self._bcast_object(self._saved_state, root_rank=self._root))
            self._set_attrs()

    def committed(self) -> Any:
        return dict(self._saved_state)

    def load_committed(self, data: Any) -> None:
        self._saved_state = dict(data)
        self.restore()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def _write_every() -> int:
    return _config.elastic_write_every()


def state_file(func: Callable[..., Any]) -> str | None:
    """Where ``run(func)`` writes its commits through: under ``MATEX_CHECKPOINT_DIR``
    (``matexrun --elastic``), one file per function; None when that is not set.

    The name holds the function's module and name and a digest of the file that defines
    it, so another script's ``__main__.train`` never resumes this one's commit.
    """
    import hashlib

    directory = _config.checkpoint_dir()
    if not directory:
        return None
    name = "%s.%s" % (getattr(func, "__module__", ""), getattr(func, "__qualname__", "func"))
    code = getattr(func, "__code__", None)
    source = os.path.abspath(code.co_filename) if code is not None else ""
    digest = hashlib.sha1(source.encode("utf-8")).hexdigest()[:12]
    return os.path.join(directory, "elastic-%s-%s.pkl" % ("".join(
        c if c.isalnum() or c in "._-" else "_" for c in name), digest))


def _sync(state: State) -> None:
    """``state.sync()`` from the lowest rank holding the most commits (collective)."""
    counts = _runtime.control().allgather(state._commits)
    state._root = counts.index(max(counts))
    try:
        state.sync()
    finally:
        state._root = 0
    state._commits = max(counts)


class _Recovering(_recovery.State):
    """``state`` as the recovery loop sees it: Horovod's restore, reset, sync order."""

    def __init__(self, state: State, synced: list) -> None:
        self.state, self.synced = state, synced

    def restore(self) -> None:
        self.state.restore()
        self.state.on_reset()

    def sync(self, root: int = 0) -> None:
        """``root`` aside: Horovod's states come from the survivor with the most commits."""
        _sync(self.state)
        self.synced.append(True)

    def arrays(self) -> list:
        return self.state.arrays()


def _resume(state: State, path: str | None) -> bool:
    """On rank 0, load the commit a previous launch wrote to ``path``; whether it did."""
    if path is None or state._rank() != 0 or not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        saved = pickle.load(f)
    state.load_committed(saved["state"])
    if saved.get("extras") is not None:
        state.load_disk_extras(saved["extras"])
    state._commits = int(saved["commits"])
    print("matex: hvd.elastic: resumed from commit %d in %s" % (state._commits, path),
          flush=True)
    return True


def _remove(state: State, path: str) -> None:
    """On rank 0, remove the finished function's commit file (the next run starts afresh)."""
    if state._rank() == 0 and os.path.exists(path):
        os.remove(path)


# function's name -> how often run(func) was entered (fault injection)
_calls: dict = _state.table("horovod.elastic.calls", lifetime="process")


def run(func: F) -> F:
    """Run ``func(state, ...)`` to its end across rank failures (Horovod's ``hvd.elastic.run``).

    The state is synchronised from rank 0 first (or from the commit a previous
    launch left on disk, see the module doc); after a rank failure it is
    restored to the last commit, reset callbacks run, it is synchronised from
    the survivor holding the most commits, and ``func`` runs again. ``func``
    must derive where to go on from ``state`` (``state.batch``, ``state.epoch``)
    and divide its data by ``hvd.rank()``/``hvd.size()`` when called.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        path = state_file(func)
        state._file = path
        key = "%s.%s" % (getattr(func, "__module__", ""), getattr(func, "__qualname__", ""))
        _faults.maybe_fail(_calls.setdefault(key, 0), "elastic")
        _calls[key] += 1
        resumed, synced, finished = [], [], []

        # Every collective runs inside the recovery loop, from the first: a rank lost while
        # the commit on disk is read, the state synchronised, or the finished function's
        # file removed is recovered like one lost in a step (before, such a loss outside
        # the loop ended every survivor).
        def body():
            if not resumed:   # again after a loss in it: the new rank 0 reads the file
                on_every_rank(_runtime.control(), _resume, state, path,
                              what="hvd.elastic: resuming from %s" % path)
                resumed.append(True)
                synced.clear()
            if not synced:
                _sync(state)
                synced.append(True)
            if not finished:
                finished.append(func(state, *args, **kwargs))
            if path is not None:
                on_every_rank(_runtime.control(), _remove, state, path,
                              what="hvd.elastic: removing %s" % path)
            return finished[0]

        try:
            return _recovery.run(body, [_Recovering(state, synced)])
        finally:
            state._file = None

    return wrapper  # type: ignore[return-value]


def run_fn(func: F, reset: Callable[[], Any] | None = None) -> F:
    """Horovod's ``horovod.common.elastic.run_fn``: ``run(func)`` (``reset`` is not needed:
    MaTEx's communicator is replaced by the recovery itself)."""
    return run(func)


__all__ = ["State", "ObjectState", "run", "run_fn"]
