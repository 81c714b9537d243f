"""Keras Tuner tuners, distributed over MPI without changing the script.

``install()`` wraps five methods of Keras Tuner's ``BaseTuner`` (through
``matex._compat``), so that every tuner (``RandomSearch``,
``BayesianOptimization``, ``Hyperband``, a custom ``Tuner`` subclass, and
MaTEx's own) runs distributed when its script runs on several ranks
(``python -m matex`` installs this hook when the script imports
``keras_tuner``):

* ``__init__``: the ranks split into groups of ``MATEX_RANKS_PER_TRIAL`` (all
  ranks when unset: one data-parallel ``fit`` per trial over every rank, as
  without the hook); world rank 0 builds its tuner first (it alone deletes,
  creates and reloads the tuner directory), then the others; the owner serves
  its oracle from a thread (``matex._workgroups.service``) and every rank's ``tuner.oracle``
  becomes a ``GroupOracle``;
* ``search``: the group's communicator is installed for the search, so each
  trial is a MaTEx data-parallel ``fit`` over its group; at the end every rank
  receives the owner's final trials, so ``get_best_hyperparameters()`` and
  ``get_best_models()`` answer the same everywhere;
* ``save``, ``project_dir``, ``get_trial_dir``: only the owner writes the tuner
  directory. Other ranks write a trial's files (checkpoint, build config) to a
  private scratch directory; the group leader ships them with the trial's
  result and the owner writes them, atomically.

Keras Tuner's own JSON writer is made atomic (temporary file + rename), so
the directory on disk is always a consistent state to resume from, and to
take over from: under ULFM, when the owner dies, the lowest rank alive
reloads the oracle from it (``Search.take_over``), gives the trials still
running back to their groups and serves the others, who resend what was not
acknowledged. At the end every rank asks the owner whether the whole search is
over (``finish``), so no rank leaves while another may still need an owner: a
rank waiting in a collective could not take the oracle over.

A search never hangs on one rank's error: a trial that raises on one rank of
its group is recorded failed while its peers are released from the collective
they wait in (``_groups.finish_trial``); an error of the oracle (Keras Tuner's
``max_consecutive_failed_trials``, an oracle that raises) or of the service
ends the search with that error on every rank.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time

from matex import _compat, _config, _runtime, _state
from matex._everywhere import agree_error, on_every_rank, on_root
from matex._workgroups.service import Client, Server
from matex.hpo import _service
from matex.hpo._groups import TrialGroups, finish_trial

FINGERPRINT = "matex_search.json"
DRAIN = "matex_drain.json"   # the ranks told that the search is over (for a takeover)
_lock = threading.Lock()
_now = _state.namespace("hpo.tuner", installed=False)
_forced = _state.local("hpo.tuner.forced")   # ranks per trial that minimize() asks for


@contextlib.contextmanager
def ranks_per_trial(k):
    """Tuners built inside the block are distributed with ``k`` ranks per trial."""
    previous = getattr(_forced, "k", None)
    _forced.k = k
    try:
        yield
    finally:
        _forced.k = previous


def _wanted_k():
    forced = getattr(_forced, "k", None)
    if forced is not None:
        return forced
    k = _config.ranks_per_trial()
    size = _runtime.size()
    if k is None and size == 1:
        return None   # one process: Keras Tuner as it is
    return size if k is None else k


def install():
    """Wrap ``BaseTuner`` so tuners run distributed (idempotent; imports keras_tuner)."""
    with _lock:
        if _now.installed:
            return
        from matex._keras.calls import patch

        base = _compat.base_tuner_class()
        patch(base, "__init__", _init)
        patch(base, "search", _search)
        patch(base, "save", _save)
        patch(base, "get_trial_dir", _get_trial_dir)
        patch(base, _compat.TUNER_RUN_TRIAL, _run_trial)
        original_dir = base.project_dir

        def project_dir(self):
            search = getattr(self, "_matex_search", None)
            if search is not None and not search.groups.owner:
                return os.path.join(str(self.directory), self.project_name)
            return original_dir.fget(self)

        base.project_dir = property(project_dir)
        utils = _compat.kt_utils()
        patch(utils, "save_json", _atomic_save_json)
        _now.installed = True


def _atomic_save_json(original):
    def save_json(path, obj):
        path = str(path)
        if "://" in path:
            return original(path, obj)
        import json

        text = json.dumps(obj)
        _service.write_atomically(path, text.encode())
        return text

    return save_json


class SearchError(ValueError):
    """A search that cannot start: a bad space, or a directory written by another search."""


def _fingerprint(tuner, space):
    objective = tuner.oracle.objective
    objectives = getattr(objective, "objectives", None) or [objective]
    return {"oracle": type(tuner.oracle).__name__,
            "objective": [[o.name, o.direction] for o in objectives],
            "space": {p.name: [type(p).__name__, _plain(p.get_config())] for p in space.space}}


def _plain(config):
    import json

    return json.loads(json.dumps(config, default=str))


def _fresh_space(tuner):
    """The space the script declares now (not the one a reloaded oracle remembers)."""
    space = getattr(tuner, "_matex_space", None)
    if space is not None:
        return space
    from keras_tuner import HyperParameters

    hp = HyperParameters()
    if tuner.hypermodel is not None:
        tuner.hypermodel.declare_hyperparameters(hp)
        try:
            tuner.hypermodel.build(hp)
        except Exception:  # noqa: BLE001 - a build that needs data: compare what was declared
            pass
    return hp


def _check_directory(tuner):
    """Owner: refuse a project directory written by a different search; record this one."""
    import json

    path = os.path.join(tuner.project_dir, FINGERPRINT)
    mine = _fingerprint(tuner, _fresh_space(tuner))
    if os.path.exists(path):
        with open(path) as f:
            theirs = json.load(f)
        problems = []
        if theirs["oracle"] != mine["oracle"]:
            problems.append("oracle %s, not %s" % (theirs["oracle"], mine["oracle"]))
        if theirs["objective"] != mine["objective"]:
            problems.append("objective %s, not %s" % (theirs["objective"], mine["objective"]))
        for name, value in mine["space"].items():
            if name not in theirs["space"]:
                problems.append("no hyperparameter %r" % name)
            elif theirs["space"][name] != value:
                problems.append("hyperparameter %r is %s, not %s" % (
                    name, theirs["space"][name], value))
        if problems:
            raise SearchError(
                "matex.hpo: %s was written by another search (%s); use another directory or "
                "project_name, or overwrite=True" % (tuner.project_dir, "; ".join(problems)))
    elif os.path.exists(os.path.join(tuner.project_dir, "oracle.json")):
        return   # a project Keras Tuner wrote alone: resumed as Keras Tuner would
    else:
        _service.write_atomically(path, json.dumps(mine).encode())


def _init(original):
    from matex._keras.calls import bind

    def init(self, *args, **kwargs):
        k = _wanted_k()
        if k is None:
            return original(self, *args, **kwargs)
        bound = bind(original, self, *args, **kwargs)
        groups = TrialGroups(k)   # the same ValueError on every rank when k does not divide
        search = Search(groups)
        self._matex_search = search

        def build_owner():
            if groups.owner:
                original(*bound.args, **bound.kwargs)
                _check_directory(self)
                _service.forget_finished_retries(self.oracle)

        def build_others():
            if not groups.owner:
                bound.arguments["overwrite"] = False   # only the owner deletes the directory
                original(*bound.args, **bound.kwargs)

        # the owner first (it alone deletes, creates and reloads the directory), then the
        # others; an error anywhere is raised on every rank
        on_every_rank(groups.service, build_owner, error_type=SearchError,
                      what="matex.hpo: the oracle's owner could not start the search")
        on_every_rank(groups.service, build_others, error_type=SearchError,
                      what="matex.hpo: a rank could not start the search")
        search.attach(self)

    return init


def _search(original):
    def search(self, *args, **kwargs):
        state = getattr(self, "_matex_search", None)
        if state is None:
            return original(self, *args, **kwargs)
        state.begin(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            state.end(self)

    return search


def _run_trial(original):
    """Under ULFM, a trial whose group lost a rank is run again by the shrunk group.

    ``fit``'s recovery loop carries a trial on when a rank is lost while it
    trains; a rank lost before that loop starts (e.g. in ``fit``'s set-up, or in
    a collective of the trial function itself) would otherwise fail the trial:
    the survivors shrink their group and run it again from its start.
    """
    def run(self, trial, *args, **kwargs):
        from matex import _resilience

        state = getattr(self, "_matex_search", None)
        for attempt in range(8):
            try:
                return original(self, trial, *args, **kwargs)
            except Exception as exc:
                if state is None or not trial_in_search(self) or attempt == 7 \
                        or _runtime.ft_mode() != "ulfm" or not _resilience.is_failure(exc):
                    raise
                _service.log.warning("matex.hpo: trial %s lost a rank of its group; the %d "
                                     "left run it again", trial.trial_id, _runtime.size())
                _resilience.recover()

    return run


def trial_in_search(tuner) -> bool:
    oracle = getattr(tuner, "oracle", None)
    return isinstance(oracle, GroupOracle) and oracle.in_search


def _save(original):
    def save(self):
        state = getattr(self, "_matex_search", None)
        if state is not None and not state.groups.owner:
            return None   # only the owner writes the tuner directory
        return original(self)

    return save


def _get_trial_dir(original):
    def get_trial_dir(self, trial_id):
        state = getattr(self, "_matex_search", None)
        if state is None:
            return original(self, trial_id)
        if state.scratch is not None and trial_id == state.current:
            # the trial this rank runs now: its files go to a private copy, then to the owner
            # (also on a rank that took the oracle over: the copy is shipped to itself)
            path = os.path.join(state.scratch, "trial_%s" % trial_id)
            os.makedirs(path, exist_ok=True)
            return path
        if state.groups.owner:
            return original(self, trial_id)
        return os.path.join(self.project_dir, "trial_%s" % trial_id)

    return get_trial_dir


class Search:
    """One tuner's distributed search: groups, service, and the oracle every rank sees."""

    def __init__(self, groups: TrialGroups):
        self.groups = groups
        self.handler = self.server = None
        self.scratch = None
        self.local = None   # the tuner's own oracle object on this rank
        self.current = None  # id of the trial this rank runs
        self.tuner = self.client = None

    def attach(self, tuner):
        """After ``__init__``: serve the oracle (owner), give every rank its ``GroupOracle``."""
        self.local, self.tuner = tuner.oracle, tuner
        if self.groups.owner:
            self._handle()
            self._serve()
        self.client = Client(self.groups, self.handler, self.take_over, what="the oracle",
                             source="the tuner directory")
        tuner.oracle = GroupOracle(self.local, self.client, self)

    def _handle(self):
        get_trial_dir = _compat.base_tuner_class().get_trial_dir._matex_original
        tuner = self.tuner
        self.handler = _service.Handler(self.local, lambda i: get_trial_dir(tuner, i),
                                        self.groups.count)
        self.handler.dead_groups = self._dead_groups
        self.handler.drain_path = os.path.join(tuner.project_dir, DRAIN)
        return self.handler

    def _serve(self, failed=()):
        if self.server is None:
            self.server = Server(self.groups.service, self.handler, self._on_failure,
                                 what="the oracle")
            self.server.failed |= set(failed)
            self.server.start()

    def take_over(self, dead, serve=True):
        """The owner died: this rank (the lowest alive) owns the oracle from now on.

        The oracle is reloaded from the tuner directory, which the owner wrote
        atomically after every result. Keras Tuner's reload sends the trials
        that were running to the retry queue; those whose group still has a
        rank go back to that group instead (it is still training them, and
        reports them here), those of groups with no rank left stay queued, and
        those with a result on disk are never handed out again. Returns the
        ``Handler`` this rank's own requests now go to.
        """
        from matex.hpo._service import log

        oracle = self.local
        oracle.trials = {}
        running = _compat.oracle_reload_from_disk(oracle)
        queue = _compat.oracle_retry_queue(oracle)
        lost = self._dead_groups(dead)
        for tuner_id, trial_id in running.items():
            trial = oracle.trials.get(trial_id)
            if trial is None or trial_id in oracle.end_order or tuner_id in lost:
                continue
            queue[:] = [t for t in queue if t != trial_id]
            trial.status = "RUNNING"
            oracle.ongoing_trials[tuner_id] = trial
        _service.forget_finished_retries(oracle)
        oracle.save()
        log.warning("matex.hpo: rank %d took the oracle over from %s: %d trials recorded, "
                    "%d running, %d to run again", self.groups.world_rank,
                    self.tuner.project_dir, len(oracle.end_order), len(oracle.ongoing_trials),
                    len(queue))
        self._handle()
        self.handler.lose_groups(lost)
        # in the end-of-search drain: ranks the dead owner let go will not ask again
        self.handler.released |= self.handler.load_drain()
        self.handler.stop_groups({group_id(g) for g in self.groups.lost(
            self.handler.released | set(dead))} - lost)
        if serve:
            self._serve(dead)
        return self.handler

    def _on_failure(self, failed):
        """Owner, ULFM: groups left with no rank give their trial back to the queue."""
        self.handler.requeue(group_id(g) for g in self.groups.lost(failed))

    def begin(self, tuner):
        space = tuner.oracle.get_space()
        if not space.space and tuner.hypermodel is not None:
            raise SearchError("matex.hpo: the hyperparameter space is empty: the model-building "
                              "function declares no hyperparameter (hp.Int, hp.Float, "
                              "hp.Choice, ...), so there is nothing to search")
        if self.groups.refresh() and self.groups.owner:
            self.handler.groups = self.groups.count   # after a search that lost ranks
        if self.groups.owner:
            self._serve()
            self.handler.new_search()
        self.scratch = None if self.groups.owner else tempfile.mkdtemp(prefix="matex-hpo-")
        self.groups.service.Barrier()
        self.groups.enter()
        tuner.oracle.in_search = True
        tuner.oracle.finished = False
        self.started = time.time()

    def end(self, tuner):
        oracle = tuner.oracle
        oracle.in_search = False
        # every rank waits until the whole search is over: until then a group may still
        # have to resend a result, and the oracle's owner may die: the lowest rank alive
        # then takes it over, leader or not, when its own request fails (a rank waiting in
        # a collective here could not, and the others would wait for it)
        me = self.groups.service.Get_rank()
        while not self.client("finish", group_id(self.groups.index), me):
            time.sleep(0.05)
        if self.groups.owner:
            # answer until every rank alive has its answer
            everyone = set(range(self.groups.service.Get_size()))
            while not everyone <= self.handler.released | self.server.failed:
                time.sleep(0.01)
            self.server.stop()
            self.server = None
        self.groups.shrink_service()

        def snapshot():
            if not self.groups.owner:
                return None
            if self.handler is None:
                # the owner died after telling every rank that the search was over: every
                # result is on disk, the new rank 0 reads them for the others
                self.take_over(set(), serve=False)
            return self.handler.op_snapshot()

        try:
            final = on_root(self.groups.service, snapshot, error_type=SearchError,
                            what="matex.hpo: the search's results")
        finally:
            self.groups.leave()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if not self.groups.owner:
            from keras_tuner import HyperParameters

            self.local.trials = {i: _service.trial_from_state(s)
                                 for i, s in final["trials"].items()}
            self.local.hyperparameters = HyperParameters.from_config(final["space"])
        oracle.finished = True
        if final["fatal"]:
            raise RuntimeError("matex.hpo: the search stopped on the oracle's error: %s"
                               % final["fatal"])

    def _dead_groups(self, dead=None):
        """Ids of the groups with no rank left (of the failed service ranks known here)."""
        if dead is None:
            dead = self.server.failed if self.server is not None else set()
        return {group_id(g) for g in self.groups.lost(dead)}


def group_id(index):
    return "matex-group-%d" % index


_SEVERITY = {"COMPLETED": 0, "INVALID": 1, "FAILED": 2}


class GroupOracle:
    """The oracle as every rank of a group sees it during a distributed search.

    The group leader asks the owner; the trial is broadcast over the group, so
    every rank of the group runs the same trial. Results are held back until
    ``end_trial``, where the group agrees on the outcome: a trial that raised
    on any of its ranks is recorded as failed (with that rank's traceback),
    never half-reported. Outside ``search`` every rank asks the owner directly;
    after it, queries are answered from the owner's final trials.
    """

    def __init__(self, local, client, search: Search):
        self.__dict__.update(_local=local, _client=client, _search=search, in_search=False,
                             finished=False, _current=None, _pending=[], _next=None)

    def __getattr__(self, name):
        return getattr(self._local, name)

    def __setattr__(self, name, value):
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self._local, name, value)

    # -- the search loop's calls -----------------------------------------------------------

    def create_trial(self, tuner_id):
        from keras_tuner.src.engine import trial as trial_module  # noqa: F401 - Trial states

        if not self.in_search:
            return _service.trial_from_state(self._client("create_trial", tuner_id))
        def ask():
            # a leader lost meanwhile: the new one asks again and gets the same trial back
            state, error = None, None
            if TrialGroups.leader():
                state, self.__dict__["_next"] = self._next, None
                if state is None:
                    try:
                        state = self._client("create_trial",
                                             group_id(self._search.groups.index))
                    except Exception as exc:  # noqa: BLE001 - raised on every rank of the group
                        error = exc
            # the group waits for its leader's answer: an error there is everyone's
            agree_error(_runtime.control(), error, error_type=SearchError,
                        what="matex.hpo: asking the oracle for a trial")
            return _runtime.control().bcast(state, root=0)

        state = TrialGroups.resilient(ask)
        trial = _service.trial_from_state(state)
        self.__dict__["_current"] = trial
        self._search.current = trial.trial_id
        self.__dict__["_pending"] = []
        if trial.status == "IDLE":
            time.sleep(0.05)   # the oracle waits for running trials: ask again shortly
        return trial

    def update_trial(self, trial_id, metrics, step=0):
        if not self.in_search:
            return _service.trial_from_state(
                self._client("update_trial", trial_id, metrics, step))
        self._pending.append((trial_id, metrics, step))   # sent once the group agrees
        return self._current

    def end_trial(self, trial):
        if not self.in_search:
            return self._client("end_trial", trial.get_state(), {})

        def outcome():
            # every rank of the group at the trial's end first: one that raised releases
            # its peers from the collective they wait in (they raise there too)
            released = finish_trial(_runtime.comm())
            return _runtime.control().allgather(
                (str(trial.status), trial.message, sorted(released)))

        outcomes = TrialGroups.resilient(outcome)
        consequences = {r for _, _, released in outcomes for r in released}
        causes = [r for r in range(len(outcomes)) if r not in consequences] or \
            list(range(len(outcomes)))
        worst = max(causes, key=lambda r: _SEVERITY.get(outcomes[r][0], 1))
        status, message, _ = outcomes[worst]
        if status != "COMPLETED":
            trial.status = status
            trial.message = "on rank %d of its group (world rank %d):\n%s" % (
                worst, self._search.groups.world_rank - _runtime.rank() + worst, message)
        search = self._search
        error = None
        if TrialGroups.leader():
            files = {}
            if search.scratch is not None:
                directory = os.path.join(search.scratch, "trial_%s" % trial.trial_id)
                if os.path.isdir(directory):
                    files = _service.read_tree(directory)
            # one round trip: the reports, the result, and the answer to the next
            # create_trial (Keras Tuner's loop asks for it next), kept until then
            try:
                self.__dict__["_next"] = self._client(
                    "end_trial", trial.get_state(), files,
                    self._pending if status == "COMPLETED" else [],
                    group_id(search.groups.index))
            except Exception as exc:  # noqa: BLE001 - raised on every rank of the group
                error = exc
        # the group goes on to its next trial only if its leader could report this one
        TrialGroups.resilient(lambda: agree_error(
            _runtime.control(), error, error_type=SearchError,
            what="matex.hpo: reporting trial %s" % trial.trial_id))
        if search.scratch is not None:
            shutil.rmtree(os.path.join(search.scratch, "trial_%s" % trial.trial_id),
                          ignore_errors=True)
        self.__dict__["_pending"] = []

    def get_trial(self, trial_id):
        current = self._current
        if self.in_search and current is not None and current.trial_id == trial_id:
            if not TrialGroups.leader() or not self._pending:
                return current
        if self.finished or (self.in_search and not TrialGroups.leader()):
            return self._local.get_trial(trial_id)
        return _service.trial_from_state(self._client("get_trial", trial_id))

    # -- queries --------------------------------------------------------------------------

    def get_space(self):
        from keras_tuner import HyperParameters

        if self.finished:
            return self._local.get_space()
        return HyperParameters.from_config(self._client("get_space"))

    def update_space(self, hyperparameters):
        if self.finished:
            return self._local.update_space(hyperparameters)
        return self._client("update_space", hyperparameters.get_config())

    def get_best_trials(self, num_trials=1):
        if self.finished:
            return self._local.get_best_trials(num_trials)
        return [_service.trial_from_state(s) for s in self._client("get_best_trials", num_trials)]

    def remaining_trials(self):
        if self.finished:
            return self._local.remaining_trials()
        return self._client("remaining_trials")

    def save(self):
        handler = self._search.handler
        if handler is not None:
            with handler.lock:
                self._local.save()

    def reload(self):
        if self._search.groups.owner:
            with self._search.handler.lock:
                self._local.reload()
