"""``minimize``: distributed search over any objective function, not only Keras models.

It is a Keras Tuner search underneath (a ``BaseTuner`` whose trial calls
``fn``), distributed by ``matex.hpo._tuner``: groups of ``ranks_per_trial``
ranks, one oracle owner, results recorded in a tuner directory (resumable).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from matex import _runtime

if TYPE_CHECKING:
    import keras_tuner as kt


def _oracle(oracle, objective, max_trials, seed, space):
    import keras_tuner as kt

    if isinstance(oracle, kt.Oracle):
        if not oracle.hyperparameters.space:
            oracle.update_space(space)
        return oracle
    # failed trials never end the search (Keras Tuner stops after 3 in a row by default)
    common = dict(objective=objective, max_trials=max_trials, seed=seed,
                  hyperparameters=space, max_consecutive_failed_trials=None)
    if oracle == "random":
        return kt.oracles.RandomSearchOracle(**common)
    if oracle == "genetic":
        from matex.hpo import GeneticOracle

        return GeneticOracle(**common)
    if oracle == "lazy-gp":
        from matex.hpo import LazyBayesianOracle

        return LazyBayesianOracle(**common)
    raise ValueError("oracle must be 'random', 'genetic', 'lazy-gp' or a keras_tuner Oracle, "
                     "not %r" % (oracle,))


def _function_tuner_class():
    import keras_tuner as kt

    class FunctionTuner(kt.engine.base_tuner.BaseTuner):
        """A trial is one call of ``fn(hp, comm)`` on every rank of a group."""

        def __init__(self, fn, space, **kwargs):
            self._fn, self._matex_space = fn, space
            super().__init__(**kwargs)

        def run_trial(self, trial, *args, **kwargs):
            from matex.hpo._groups import checked_class

            # collectives on this comm are agreed on first, so a peer whose call raised
            # releases this rank from one it waits in (see matex.hpo._groups)
            comm = _runtime.comm()
            if comm.Get_size() > 1:
                comm = checked_class()(comm)
            value = self._fn(trial.hyperparameters, comm)
            return float(value)

    return FunctionTuner


def minimize(fn: Callable, space: kt.HyperParameters, oracle: str | kt.Oracle = "lazy-gp",
             max_trials: int = 40, ranks_per_trial: int = 1, seed: int = 0,
             directory: str | None = None, project_name: str = "minimize",
             overwrite: bool | None = None,
             verbose: int = 0) -> tuple[kt.HyperParameters, float]:
    """Minimise ``fn(hp, comm) -> float`` over ``space``; ``(best_hp, best_value)`` on every rank.

    ``fn`` runs on every rank of a group of ``ranks_per_trial`` ranks; ``comm``
    is the group's mpi4py communicator (also MaTEx's communicator during the
    call, so a Keras ``fit`` inside is data-parallel over the group). ``space``
    is a ``keras_tuner.HyperParameters``; ``oracle`` is ``"random"``,
    ``"genetic"``, ``"lazy-gp"`` or a Keras Tuner ``Oracle``. A call that raises
    on any rank of its group records the trial as failed (with the traceback)
    and the search goes on. ``directory``: where the search is recorded
    (default: a fresh temporary directory); with ``overwrite=False`` (the
    default when a directory is given) a stopped search resumes there.
    ``verbose=1`` shows Keras Tuner's per-trial table (on rank 0).
    """
    import keras_tuner as kt

    from matex.hpo import _tuner

    if not isinstance(space, kt.HyperParameters):
        raise TypeError("space must be a keras_tuner.HyperParameters, not %s"
                        % type(space).__name__)
    if not space.space:
        raise ValueError("matex.hpo.minimize: the hyperparameter space is empty; declare "
                         "hyperparameters first, e.g. space.Float('x', -5.0, 10.0)")
    if not isinstance(max_trials, int) or max_trials < 1:
        raise ValueError("max_trials must be a whole number >= 1, not %r" % (max_trials,))
    _tuner.install()
    comm = _runtime.comm()
    from matex._workgroups.groups import as_launched
    from matex.hpo._groups import check_ranks_per_trial

    check_ranks_per_trial(ranks_per_trial, as_launched(comm.Get_size()))
    if directory is None:
        from matex._everywhere import on_root

        directory = on_root(   # rank 0 makes it; its error is every rank's
            comm, tempfile.mkdtemp, prefix="matex-minimize-", error_type=_tuner.SearchError,
            what="matex.hpo.minimize: a directory for the search")
        overwrite = True if overwrite is None else overwrite
    directory = os.fspath(directory)
    overwrite = False if overwrite is None else overwrite
    objective = kt.Objective("value", "min")
    with _tuner.ranks_per_trial(ranks_per_trial):
        tuner = _function_tuner_class()(
            fn, space, oracle=_oracle(oracle, objective, max_trials, seed, space),
            directory=directory, project_name=project_name, overwrite=overwrite)
    tuner.search(verbose=verbose)
    best = tuner.oracle.get_best_trials(1)
    if not best or best[0].status != "COMPLETED":
        failed = [t for t in tuner.oracle.trials.values() if t.message]
        raise RuntimeError("matex.hpo.minimize: no trial completed%s" % (
            "; the last failure:\n%s" % failed[-1].message if failed else ""))
    return best[0].hyperparameters, float(best[0].score)
