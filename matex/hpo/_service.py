"""The oracle's side of a distributed search: the owner's request handler and its files.

One rank owns the oracle and serves it to the group leaders over MPI
(``matex._workgroups.service``: ``Server``, ``Client``, the takeover); this
module is what is search-specific about it. ``Handler`` answers the requests
(``create_trial``, ``end_trial``, ``finish``, ...) with the real oracle behind
a lock, so the owner's main thread (which trains trials too) and the service
thread never touch the oracle at once. Trials travel as ``Trial.get_state()``
dictionaries; files a trial wrote on another rank travel with its
``end_trial`` and are written by the owner, atomically (``write_atomically``).

Under ULFM the owner itself may die; the lowest rank alive then takes over
(``matex.hpo._tuner.Search.take_over``): it reloads the oracle from the tuner
directory (written atomically after every result), gives the trials still
running back to their groups, and serves. Requests are safe to resend: a
result already recorded is ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from matex import _atomic, _state

from matex._workgroups.machine import LOST, GroupWork

log = logging.getLogger("matex.hpo")


def trial_from_state(state):
    from keras_tuner.src.engine import trial as trial_module

    return trial_module.Trial.from_state(state)


# the writes of the request being answered: path -> bytes
_batch = _state.local("hpo.service.batch")


def write_atomically(path: str, data: bytes):
    """Write ``data`` to ``path`` through a temporary file and a rename (never half-written).

    Inside ``batched_writes()`` the write is held until the block ends; a file
    written several times in one request is written once, with its last content.

    No fsync: what the takeover needs is that a *process* that dies never leaves
    a half-written file, which the rename gives (the data is in the page cache,
    or on a shared file system after close). An fsync per result cost the
    owner ~40 ms per trial and held up every group's next request.
    """
    pending = getattr(_batch, "files", None)
    if pending is not None:
        pending.pop(path, None)   # re-inserted last: files land in the order last written
        pending[path] = data
        return
    _write_now(path, data)


def _write_now(path: str, data: bytes):
    _atomic.write(path, data, mkdir=True)


@contextlib.contextmanager
def batched_writes():
    """Hold this thread's atomic writes until the block ends, then write each file once.

    One request rewrites the same files several times (Keras Tuner saves the
    trial and the oracle at every step: ending a trial and creating the next
    rewrote ``oracle.json`` three times), and on ext4 each replacing rename
    costs about a millisecond. Every file is on disk when the block ends, i.e.
    before the request is answered, so a result acknowledged is a result on disk.
    Nested blocks join the outer one.
    """
    if getattr(_batch, "files", None) is not None:
        yield
        return
    _batch.files = {}
    try:
        yield
    finally:
        files, _batch.files = _batch.files, None
        for path, data in files.items():
            _write_now(path, data)


def read_tree(directory: str) -> dict:
    """Every file under ``directory``: relative path -> bytes."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


class Handler:
    """The owner's side: the real oracle behind a lock, one method per request.

    Each group's place in the search is a ``GroupWork`` machine, keyed by its
    tuner id: waiting (the oracle tracks which trial it runs), finishing (told
    STOPPED, or done with the search and draining), lost (no rank left).
    """

    def __init__(self, oracle, trial_dir, groups: int):
        self.oracle, self.trial_dir = oracle, trial_dir
        self.lock = threading.RLock()
        self.work = {}                # tuner id -> GroupWork (a group not seen yet: waiting)
        self.released = set()         # service ranks told that the whole search is over
        self.drain_path = None        # where ``released`` is kept for a takeover (a file)
        self.fatal = None   # the oracle's error that ended the search (raised on every rank)
        self.groups = groups
        self.dead_groups = set        # () -> tuner ids of groups with no rank left

    SEARCH_OPS = ("create_trial", "update_trial", "end_trial")

    def __call__(self, op, args):
        try:
            with self.lock, batched_writes():
                return getattr(self, "op_" + op)(*args)
        except Exception as exc:
            # a search step that failed here (e.g. a trial's files cannot be written):
            # the asking group raises it now, every other rank when the search ends
            if op in self.SEARCH_OPS and self.fatal is None:
                self.fatal = "%s: %s" % (type(exc).__name__, exc)
                log.error("matex.hpo: the search stops: %s", self.fatal)
            raise

    def _oracle_call(self, method, *args, **kwargs):
        """An oracle method inside the search; its error ends the search on every rank.

        The error is kept (``fatal``: every group is told STOPPED from now on and
        every rank raises it when the search ends) instead of raised on the one
        rank that asked. Keras Tuner's lock, which its ``@synchronized`` leaves
        held after a raise, is released: the next call (from the other thread)
        would wait for it for ever.
        """
        try:
            return getattr(self.oracle, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. too many failures in a row
            from matex import _compat

            _compat.oracle_unlock_after_error(self.oracle)
            if self.fatal is None:
                self.fatal = "%s: %s" % (type(exc).__name__, exc)
                log.error("matex.hpo: the search stops: %s", self.fatal)
            return None

    def op_create_trial(self, tuner_id):
        work = self._work(tuner_id)
        trial = None
        # a lost group's request was sent by a rank that died since: no trial for it
        if self.fatal is None and work.state != LOST:
            trial = self._oracle_call("create_trial", tuner_id)
        if trial is None:   # the search ended with an error: every group stops
            if work.state != LOST:
                work.fire("finish")
            from keras_tuner.src.engine import trial as trial_module

            return trial_module.Trial(self.oracle.get_space(), status="STOPPED").get_state()
        if trial.status == "STOPPED":
            work.fire("finish")
        return trial.get_state()

    def op_update_trial(self, trial_id, metrics, step):
        if trial_id in self.oracle.end_order or self.fatal is not None:
            return self.oracle.get_trial(trial_id).get_state()   # e.g. resent after a takeover
        trial = self._oracle_call("update_trial", trial_id, metrics, step=step)
        return (trial or self.oracle.get_trial(trial_id)).get_state()

    def op_end_trial(self, state, files, updates=(), next_for=None):
        """Record a trial's result; with ``next_for``, also answer that group's next request.

        ``updates``: the trial's ``(trial_id, metrics, step)`` reports, applied
        first (as ``update_trial`` would). ``next_for``: a tuner id; the reply is
        then the state of its next trial, created after this result is recorded
        (what its ``create_trial`` would get), so a group's hand-off between two
        trials is one round trip instead of three. Without it the reply is None.
        """
        self._end_trial(state, files, updates)
        if next_for is None:
            return None
        return self.op_create_trial(next_for)

    def _end_trial(self, state, files, updates):
        for trial_id, metrics, step in updates:
            self.op_update_trial(trial_id, metrics, step)
        trial = trial_from_state(state)
        known = self.oracle.trials.get(trial.trial_id)
        if known is not None and known.status in ("COMPLETED", "FAILED") and \
                trial.trial_id in self.oracle.end_order:
            return   # already recorded (a report resent after a takeover)
        # a trial sent back to the queue by a takeover whose group finished it after all
        from matex import _compat

        queue = _compat.oracle_retry_queue(self.oracle)
        queue[:] = [t for t in queue if t != trial.trial_id]
        if files:
            directory = self.trial_dir(trial.trial_id)
            for name, data in files.items():
                write_atomically(os.path.join(directory, name), data)
        self._oracle_call("end_trial", trial)   # recorded even after a fatal error
        # Keras Tuner saves before it drops the trial from the ongoing ones (its tuner saves
        # again afterwards): save the state where the trial is no longer running
        self.oracle.save()

    def op_get_trial(self, trial_id):
        return self.oracle.get_trial(trial_id).get_state()

    def op_get_best_trials(self, n):
        return [t.get_state() for t in self.oracle.get_best_trials(n)]

    def op_get_space(self):
        return self.oracle.get_space().get_config()

    def op_update_space(self, config):
        from keras_tuner import HyperParameters

        self.oracle.update_space(HyperParameters.from_config(config))

    def op_remaining_trials(self):
        return self.oracle.remaining_trials()

    def op_finish(self, tuner_id, rank=None):
        """A rank of a group is done; True (and the rank may leave) once every group is.

        The ranks told so are written down (``drain_path``) before the answer:
        a rank that takes the oracle over in the end-of-search drain knows who
        has left and will not ask again.
        """
        work = self._work(tuner_id)
        if work.state != LOST:   # (lost: sent by a rank that died since)
            work.fire("finish")
        everyone = {"matex-group-%d" % g for g in range(self.groups)}
        over = everyone <= self.stopped | set(self.dead_groups())
        if over and rank is not None and rank not in self.released:
            self.released.add(rank)
            self.save_drain()
        return over

    def _work(self, tuner_id) -> GroupWork:
        work = self.work.get(tuner_id)
        if work is None:
            work = self.work[tuner_id] = GroupWork(name=tuner_id)
        return work

    @property
    def stopped(self) -> set:
        """Tuner ids of the groups that take no more trials (finishing or lost)."""
        return {tuner_id for tuner_id, work in self.work.items() if work.settled}

    def stop_groups(self, tuner_ids) -> None:
        """These groups are finishing (after a takeover: the dead owner let their ranks go)."""
        with self.lock:
            for tuner_id in tuner_ids:
                self._work(tuner_id).fire("finish")

    def lose_groups(self, tuner_ids) -> None:
        """These groups have no rank left (ULFM); a group already lost stays so."""
        with self.lock:
            for tuner_id in tuner_ids:
                work = self._work(tuner_id)
                if work.state != LOST:
                    work.fire("lose")

    def new_search(self) -> None:
        """Before a search: every group waiting, no rank released (on disk too)."""
        with self.lock:
            self.work = {}
            self.released = set()
            self.save_drain()

    def save_drain(self):
        if self.drain_path is not None:
            import json

            write_atomically(self.drain_path, json.dumps(sorted(self.released)).encode())

    def load_drain(self) -> set:
        """The ranks a previous owner told that the search was over (after a takeover)."""
        import json

        try:
            with open(self.drain_path) as f:
                return set(json.load(f))
        except (OSError, ValueError, TypeError):
            return set()

    def requeue(self, tuner_ids):
        """Trials of groups with no rank left go back to the queue (run again, not counted)."""
        from matex import _compat

        with self.lock:
            for tuner_id in tuner_ids:
                trial = self.oracle.ongoing_trials.pop(tuner_id, None)
                self.lose_groups([tuner_id])
                if trial is not None and trial.trial_id not in self.oracle.end_order:
                    log.warning("matex.hpo: %s lost all its ranks; trial %s goes back to "
                                "the queue", tuner_id, trial.trial_id)
                    _compat.oracle_retry_queue(self.oracle).append(trial.trial_id)
                    self.oracle.save()

    def op_snapshot(self):
        """Everything a rank needs to answer queries locally once the search is over."""
        return {"fatal": self.fatal,
                "trials": {i: t.get_state() for i, t in self.oracle.trials.items()},
                "space": self.oracle.hyperparameters.get_config()}


def forget_finished_retries(oracle):
    """After a reload: never hand out again a trial whose result is already recorded.

    Keras Tuner's reload sends every trial that was running to the retry
    queue; one whose result was written just before the stop is not rerun.
    """
    from matex import _compat

    queue = _compat.oracle_retry_queue(oracle)
    queue[:] = [t for t in queue if t not in oracle.end_order]
