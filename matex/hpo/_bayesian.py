"""Bayesian optimisation on a lazily extended Gaussian process: ``LazyBayesianOracle``.

The surrogate is ``LazyGP``: each new result extends the Cholesky factor by one
row (O(n^2)); every ``lag`` observations the kernel's hyperparameters are
refitted by maximum marginal likelihood and the factor recomputed (O(n^3)),
as in the lazy-GP scheme of the source. While the GP is small (up to
``refit_until`` observations, 50 by default) the kernel is refitted at every
observation instead: a kernel fitted once on the random initial points and
kept for ``lag`` more is what made the early search weak (Hartmann-6, 40
evaluations, median of 10 seeds: -1.86 refitting every 20, -2.99 refitting at
every observation), and a refit of so small a GP is cheap.
Past ``refit_until`` the refits are every ``lag`` again, so the cost per
result stays the O(n^2) add plus an O(n^3) refit amortised over ``lag``.
Refits up to ``isotropic_until`` observations (by default 5 per tunable
hyperparameter) fit one length scale shared by every input, as Keras Tuner's
BO does throughout; ARD length scales after. On so few points the ARD fit
degenerates (Hartmann-6 at 21 observations: four length scales at the upper
bound, one at 0.03) and the search follows it. Median (mean, worst) best of
10 seeds at 40 evaluations (benchmarks/hpo.py's seeds; this machine gives
-3.11 for the -2.99 above), Hartmann-6: -3.11 (-2.81, -0.85) ARD throughout,
-3.19 (-3.18, -2.98) isotropic up to 30 (isotropic throughout: -3.15);
Branin: 0.3986 (0.554, 1.94) ARD throughout, 0.3987 (0.3987, 0.399)
isotropic up to 10 (up to 30: 0.4026; ARD pays early where the inputs'
scales differ). At 100 evaluations the medians are unchanged (-3.3222,
0.3979), and Branin's worst seed, stuck at 1.94 with ARD throughout, is 0.398.

The GP is a function of the completed trials alone, taken in the order they
ended, with refits at fixed counts and refit restarts seeded by (seed,
count): an oracle reloaded from its directory replays them and holds the same
GP, so a resumed search proposes what an uninterrupted one would.

Concurrent groups get different points through a constant liar: every trial
still running is added to a copy of the GP as a fantasised observation (the
mean of the results so far, by default), which collapses the GP's uncertainty
there, then removed again (``truncate``: the factor's leading block is the
factor of the real data, so this costs nothing).

The acquisition (UCB, mu - kappa * sigma, or expected improvement; the search
is a minimisation, a "max" objective is negated) is optimised over the unit
cube: random and local candidates, then a few bounded L-BFGS-B runs.
"""

import logging
import math

import keras_tuner as kt
import numpy as np
import scipy.optimize
import scipy.stats

from matex import _compat
from matex.hpo import _unit_cube
from matex.hpo._lazy_gp import LazyGP

log = logging.getLogger(__name__)

ACQUISITIONS = ("ucb", "ei")
LIARS = ("mean", "best", "worst")
_COMPLETED = kt.engine.trial.TrialStatus.COMPLETED
_RUNNING = kt.engine.trial.TrialStatus.RUNNING
_STOPPED = kt.engine.trial.TrialStatus.STOPPED


class LazyBayesianOracle(kt.Oracle):
    """GP-based Bayesian optimisation whose GP grows in O(n^2) per result.

    Args (beyond ``keras_tuner.Oracle``'s):
        num_initial_points: random trials before the GP is used (default 3 x
            the number of tunable hyperparameters, at least 3).
        lag: refit the kernel hyperparameters and refactorise every ``lag``
            observations; in between, results are added lazily.
        refit_until: up to this many observations, refit at every one (0:
            every ``lag`` from the start).
        isotropic_until: refits of a GP holding up to this many observations
            fit one length scale shared by every input; ARD length scales
            after (0: ARD from the start; default 5 x the number of tunable
            hyperparameters).
        acquisition: ``"ucb"`` (mu - kappa * sigma) or ``"ei"`` (expected
            improvement, by ``xi`` standard deviations of the results).
        kappa, xi: the acquisitions' exploration parameters.
        liar: the value fantasised for trials still running: ``"mean"``,
            ``"best"`` or ``"worst"`` of the results so far.
        kernel: ``"matern52"`` or ``"rbf"``.
        num_candidates: random candidates scored before the local optimisation.
    """

    def __init__(self, objective=None, max_trials=10, num_initial_points=None, lag=20,
                 acquisition="ucb", seed=None, hyperparameters=None, allow_new_entries=True,
                 tune_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3, kappa=2.6, xi=0.01, liar="mean",
                 kernel="matern52", num_candidates=1000, refit_until=50, isotropic_until=None):
        if acquisition not in ACQUISITIONS:
            raise ValueError("acquisition must be one of %s, not %r" % (ACQUISITIONS, acquisition))
        if liar not in LIARS:
            raise ValueError("liar must be one of %s, not %r" % (LIARS, liar))
        if int(lag) < 1:
            raise ValueError("lag must be at least 1, got %r" % lag)
        if int(refit_until) < 0:
            raise ValueError("refit_until must be at least 0, got %r" % refit_until)
        if isotropic_until is not None and int(isotropic_until) < 0:
            raise ValueError("isotropic_until must be at least 0, got %r" % isotropic_until)
        super().__init__(objective=objective, max_trials=max_trials,
                         hyperparameters=hyperparameters, tune_new_entries=tune_new_entries,
                         allow_new_entries=allow_new_entries, seed=seed,
                         max_retries_per_trial=max_retries_per_trial,
                         max_consecutive_failed_trials=max_consecutive_failed_trials)
        self.num_initial_points = num_initial_points
        self.lag = int(lag)
        self.refit_until = int(refit_until)
        self.isotropic_until = None if isotropic_until is None else int(isotropic_until)
        self.acquisition = acquisition
        self.kappa = float(kappa)
        self.xi = float(xi)
        self.liar = liar
        self.kernel = kernel
        self.num_candidates = int(num_candidates)
        self._forget_gp()

    # ---- the surrogate, a function of the completed trials ----------------------------------

    def _forget_gp(self):
        self.gp = None
        self._gp_names = None
        self._gp_trials = []
        self._last_refit = None

    def _initial_points(self):
        dims = len(_unit_cube.tunable(self.hyperparameters.space))
        return self.num_initial_points or max(3 * dims, 3)

    def _target(self, trial):
        """The value the GP models for a completed trial (minimised), or None if unusable."""
        score = trial.score
        if score is None or not math.isfinite(score):
            return None
        return -score if self.objective.direction == "max" else score

    def _sync_gp(self):
        """Bring the GP up to date with the completed trials, in the order they ended."""
        space = self.hyperparameters.space
        names = _unit_cube.names(space)
        if self.gp is None or names != self._gp_names:
            self._forget_gp()
            self.gp = LazyGP(len(names), kernel=self.kernel, seed=self.seed)
            self._gp_names = names
        known = set(self._gp_trials)
        for trial_id in self.end_order:
            trial = self.trials.get(trial_id)
            if trial_id in known or trial is None or trial.status != _COMPLETED:
                continue
            known.add(trial_id)
            target = self._target(trial)
            self._gp_trials.append(trial_id)
            if target is None:
                continue
            self.gp.add(_unit_cube.to_vector(space, trial.hyperparameters), target)
            n = self.gp.n
            if n >= self._initial_points() and (self._last_refit is None
                                                or n - self._last_refit >= self._lag(n)):
                self.gp.fit_hyperparameters(seed=[int(self.seed), n],
                                            isotropic=n <= self._isotropic_until())
                self._last_refit = n

    def _isotropic_until(self):
        if self.isotropic_until is not None:
            return self.isotropic_until
        return 5 * len(_unit_cube.tunable(self.hyperparameters.space))

    def _lag(self, n):
        """Observations between two refits when the GP holds ``n``: 1 while small, then ``lag``."""
        return 1 if n <= self.refit_until else self.lag

    # ---- proposals --------------------------------------------------------------------------

    def populate_space(self, trial_id):
        space = self.hyperparameters.space
        completed = [t for t in self.trials.values() if t.status == _COMPLETED]
        if not _unit_cube.tunable(space) or len(completed) < self._initial_points():
            return self._random()
        self._sync_gp()
        gp = self.gp
        if gp.n < 2:
            return self._random()
        rng = np.random.default_rng([int(self.seed), len(self.trials)])
        observed = gp.y
        real = gp.n
        seeds = gp.X[np.argsort(observed)[:5]]
        liar = {"mean": observed.mean(), "best": observed.min(),
                "worst": observed.max()}[self.liar]
        for trial in self.ongoing_trials.values():
            if trial.trial_id not in self._gp_trials:
                gp.add(_unit_cube.to_vector(space, trial.hyperparameters), liar)
        try:
            candidates = self._maximise_acquisition(rng, observed.min(), seeds)
        finally:
            gp.truncate(real)
        for x in candidates:
            values = _unit_cube.to_values(self.hyperparameters, x)
            if not _compat.oracle_has_tried(self, values):
                return {"status": _RUNNING, "values": values}
        log.info("LazyBayesianOracle: every good candidate was tried already; a random point")
        return self._random()

    def _random(self):
        values = _compat.oracle_random_values(self)
        if values is None:
            return {"status": _STOPPED, "values": None}
        return {"status": _RUNNING, "values": values}

    def _acquisition(self, X, best):
        """Acquisition to minimise at the rows of ``X`` (unit cube)."""
        mu, sd = self.gp.predict(X)
        if self.acquisition == "ucb":
            return mu - self.kappa * sd
        scale = max(float(self.gp.y.std()), 1e-12)
        improvement = best - mu - self.xi * scale
        sd = np.maximum(sd, 1e-12)
        z = improvement / sd
        return -(improvement * scipy.stats.norm.cdf(z) + sd * scipy.stats.norm.pdf(z))

    def _maximise_acquisition(self, rng, best, seeds, starts=5):
        """Points of the unit cube, best acquisition first (the first is the optimum found).

        Candidates: ``num_candidates`` uniform points and 20 perturbations of each
        of ``seeds`` (the best points observed); L-BFGS-B from the ``starts`` best.
        """
        d = self.gp.dim
        local = np.repeat(seeds, 20, axis=0) + rng.normal(0.0, 0.05, (len(seeds) * 20, d))
        candidates = _unit_cube.clip(np.vstack([rng.random((self.num_candidates, d)), local]))
        scores = np.concatenate([self._acquisition(chunk, best)
                                 for chunk in np.array_split(candidates,
                                                             max(1, len(candidates) // 500))])
        order = np.argsort(scores)
        found = []
        for start in candidates[order[:starts]]:
            result = scipy.optimize.minimize(
                lambda x: float(self._acquisition(x[None, :], best)[0]), start,
                method="L-BFGS-B", bounds=[(0.0, 1.0)] * d, options={"maxiter": 50})
            found.append((float(result.fun), _unit_cube.clip(result.x)))
        found.sort(key=lambda pair: pair[0])
        return [x for _, x in found] + list(candidates[order])

    # ---- saved state ------------------------------------------------------------------------

    def get_state(self):
        state = super().get_state()
        state.update({"num_initial_points": self.num_initial_points, "lag": self.lag,
                      "refit_until": self.refit_until, "isotropic_until": self.isotropic_until,
                      "acquisition": self.acquisition, "kappa": self.kappa, "xi": self.xi,
                      "liar": self.liar, "kernel": self.kernel,
                      "num_candidates": self.num_candidates})
        return state

    def set_state(self, state):
        super().set_state(state)
        self.num_initial_points = state["num_initial_points"]
        self.lag = state["lag"]
        self.refit_until = state.get("refit_until", 0)   # saved before it existed: lag only
        self.isotropic_until = state.get("isotropic_until", 0)   # likewise: ARD throughout
        self.acquisition = state["acquisition"]
        self.kappa = state["kappa"]
        self.xi = state["xi"]
        self.liar = state["liar"]
        self.kernel = state["kernel"]
        self.num_candidates = state["num_candidates"]
        self._forget_gp()   # replayed from the trials on the next proposal


class LazyBayesianSearch(kt.Tuner):
    """``keras_tuner.BayesianOptimization`` with MaTEx's lazy-GP oracle.

    Same arguments as Keras Tuner's tuner, with ``lag``, ``refit_until``,
    ``isotropic_until`` and ``acquisition`` in place of ``alpha`` and ``beta``
    (further oracle options: ``LazyBayesianOracle``).
    """

    def __init__(self, hypermodel=None, objective=None, max_trials=10, num_initial_points=None,
                 lag=20, acquisition="ucb", seed=None, hyperparameters=None,
                 tune_new_entries=True, allow_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3, refit_until=50, isotropic_until=None, **kwargs):
        oracle = LazyBayesianOracle(
            objective=objective, max_trials=max_trials, num_initial_points=num_initial_points,
            lag=lag, refit_until=refit_until, isotropic_until=isotropic_until,
            acquisition=acquisition, seed=seed,
            hyperparameters=hyperparameters,
            tune_new_entries=tune_new_entries, allow_new_entries=allow_new_entries,
            max_retries_per_trial=max_retries_per_trial,
            max_consecutive_failed_trials=max_consecutive_failed_trials)
        super().__init__(oracle=oracle, hypermodel=hypermodel, **kwargs)
