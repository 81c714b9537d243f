"""MaTEx's search algorithms in one process: LazyGP, LazyBayesianOracle, GeneticOracle.

The GP is checked against an exact GP written out here (fresh Cholesky), the
oracles through real Keras Tuner tuners whose ``run_trial`` returns the value
of an analytic function (no training), and through the oracle's own
create_trial / update_trial / end_trial calls where a test needs to hold
trials open or look inside.
"""

import math

import keras_tuner as kt
import numpy as np
import pytest
import scipy.linalg

from matex import _compat
from matex.hpo import GeneticOracle, GeneticSearch, LazyBayesianOracle, LazyBayesianSearch, LazyGP
from matex.hpo import _lazy_gp, _unit_cube

BRANIN_MIN = 0.397887


def branin(x1, x2):
    b, c, t = 5.1 / (4 * math.pi ** 2), 5 / math.pi, 1 / (8 * math.pi)
    return (x2 - b * x1 ** 2 + c * x1 - 6) ** 2 + 10 * (1 - t) * math.cos(x1) + 10


def branin_space():
    hp = kt.HyperParameters()
    hp.Float("x1", -5.0, 10.0)
    hp.Float("x2", 0.0, 15.0)
    return hp


# ---- the exact GP these tests compare with -------------------------------------------------

def exact_kernel(A, B, length_scales, signal_variance, kernel):
    d2 = (((A[:, None, :] - B[None, :, :]) / length_scales) ** 2).sum(-1)
    if kernel == "rbf":
        return signal_variance * np.exp(-0.5 * d2)
    r = np.sqrt(d2)
    return signal_variance * (1 + math.sqrt(5) * r + 5 / 3 * d2) * np.exp(-math.sqrt(5) * r)


def exact_gp(X, y, Xs, length_scales, signal_variance, noise, kernel):
    """Mean, std and log marginal likelihood of a GP on standardised y, from scratch."""
    mean, scale = y.mean(), y.std()
    ys = (y - mean) / scale
    K = exact_kernel(X, X, length_scales, signal_variance, kernel) + noise * np.eye(len(X))
    L = np.linalg.cholesky(K)
    alpha = scipy.linalg.cho_solve((L, True), ys)
    Ks = exact_kernel(X, Xs, length_scales, signal_variance, kernel)
    W = scipy.linalg.solve_triangular(L, Ks, lower=True)
    mu = mean + scale * Ks.T @ alpha
    std = scale * np.sqrt(signal_variance - (W * W).sum(0))
    lml = -0.5 * ys @ alpha - np.log(np.diag(L)).sum() - 0.5 * len(y) * math.log(2 * math.pi)
    return mu, std, lml


def sample(n, dim, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, dim))
    return X, np.sin(6 * X).sum(1) + 0.05 * rng.standard_normal(n)


# ---- LazyGP ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["matern52", "rbf"])
def test_lazy_gp_equals_an_exact_gp_after_many_adds(kernel):
    X, y = sample(200, 3)
    Xs = np.random.default_rng(1).random((40, 3))
    ls, sf2, noise = np.array([0.3, 0.5, 0.8]), 1.7, 1e-3
    gp = LazyGP(3, kernel=kernel, length_scales=ls, signal_variance=sf2, noise=noise, capacity=4)
    for x, t in zip(X, y):
        gp.add(x, t)
    mu, std = gp.predict(Xs)
    mu_exact, std_exact, lml = exact_gp(X, y, Xs, ls, sf2, noise, kernel)
    np.testing.assert_allclose(mu, mu_exact, rtol=1e-8, atol=0)
    np.testing.assert_allclose(std, std_exact, rtol=1e-8, atol=0)
    np.testing.assert_allclose(gp.log_marginal_likelihood(), lml, rtol=1e-8)
    # one point at a time takes the other (vector) path of predict
    one_mu, one_std = gp.predict(Xs[:1])
    np.testing.assert_allclose([one_mu[0], one_std[0]], [mu_exact[0], std_exact[0]], rtol=1e-8)
    # and the factor itself is the Cholesky factor of K
    np.testing.assert_allclose(gp.factor(), np.linalg.cholesky(gp.covariance()), atol=1e-10)


def test_lazy_gp_normalises_inputs_given_bounds():
    X, y = sample(50, 2)
    low, high = np.array([-5.0, 0.0]), np.array([10.0, 15.0])
    gp = LazyGP(2, bounds=(low, high), length_scales=[0.4, 0.4], noise=1e-3)
    for x, t in zip(low + X * (high - low), y):
        gp.add(x, t)
    Xs = np.random.default_rng(2).random((10, 2))
    mu, std = gp.predict(low + Xs * (high - low))
    mu_exact, std_exact, _ = exact_gp(X, y, Xs, np.array([0.4, 0.4]), 1.0, 1e-3, "matern52")
    np.testing.assert_allclose(mu, mu_exact, rtol=1e-8)
    np.testing.assert_allclose(std, std_exact, rtol=1e-8)


def test_add_extends_the_factor_without_factorising(monkeypatch):
    """add: one O(n^2) triangular solve of size n, never a Cholesky factorisation."""
    X, y = sample(300, 4)
    gp = LazyGP(4, capacity=4)
    gp.set_data(X[:50], y[:50])
    calls = {"cholesky": 0, "solve_triangular": 0, "tpsv": []}
    real_tpsv, real_cholesky = _lazy_gp.blas.dtpsv, scipy.linalg.cholesky

    def cholesky(*a, **k):
        calls["cholesky"] += 1
        return real_cholesky(*a, **k)

    def solve_triangular(*a, **k):
        calls["solve_triangular"] += 1
        raise AssertionError("add must not solve against a dense factor")

    def tpsv(n, *a, **k):
        calls["tpsv"].append(n)
        return real_tpsv(n, *a, **k)

    monkeypatch.setattr(scipy.linalg, "cholesky", cholesky)
    monkeypatch.setattr(scipy.linalg, "solve_triangular", solve_triangular)
    monkeypatch.setattr(_lazy_gp.blas, "dtpsv", tpsv)
    buffers = [gp._packed]   # the arrays themselves: a freed one's id() can be reused
    for i in range(50, 300):
        gp.add(X[i], y[i])
        if gp._packed is not buffers[-1]:
            buffers.append(gp._packed)
    assert calls["cholesky"] == 0 and calls["solve_triangular"] == 0
    assert calls["tpsv"] == list(range(50, 300))   # one solve of the current size per add
    assert gp.stats["refactorisations"] == 1         # the set_data one
    # the packed factor moved only when the capacity doubled (64 -> 128 -> 256 -> 512)
    assert len(buffers) == 4 and gp.capacity == 512


def test_refactor_and_truncate_keep_the_exact_posterior():
    X, y = sample(120, 2)
    gp = LazyGP(2, length_scales=[0.3, 0.6], noise=1e-3)
    for x, t in zip(X, y):
        gp.add(x, t)
    Xs = np.random.default_rng(3).random((20, 2))
    before = gp.predict(Xs)
    gp.refactor()
    np.testing.assert_allclose(gp.predict(Xs), before, rtol=1e-9)
    gp.truncate(80)
    mu, std, _ = exact_gp(X[:80], y[:80], Xs, np.array([0.3, 0.6]), 1.0, 1e-3, "matern52")
    np.testing.assert_allclose(gp.predict(Xs), (mu, std), rtol=1e-8)


def test_fit_hyperparameters_raises_the_likelihood_and_refactorises():
    X, y = sample(60, 2, seed=4)
    gp = LazyGP(2, length_scales=[5.0, 0.02], signal_variance=0.1, noise=0.3, seed=0)
    for x, t in zip(X, y):
        gp.add(x, t)
    before = gp.log_marginal_likelihood()
    after = gp.fit_hyperparameters()
    assert after > before + 10   # the starting kernel was deliberately poor
    h = gp.get_hyperparameters()
    assert all(_lazy_gp.LENGTH_SCALE_BOUNDS[0] <= v <= _lazy_gp.LENGTH_SCALE_BOUNDS[1]
               for v in h["length_scales"])
    _, _, lml = exact_gp(X, y, X[:1], np.array(h["length_scales"]), h["signal_variance"],
                         h["noise"], "matern52")
    np.testing.assert_allclose(after, lml, rtol=1e-8)
    assert gp.stats == {"adds": 60, "refactorisations": 1, "refits": 1}
    # refitting again from the optimum never lowers it
    assert gp.fit_hyperparameters() >= after - 1e-9


def test_an_isotropic_fit_shares_one_length_scale():
    X, y = sample(40, 3, seed=5)
    gp = LazyGP(3, length_scales=[5.0, 0.02, 1.0], signal_variance=0.1, noise=0.3, seed=0)
    gp.set_data(X, y)
    before = gp.log_marginal_likelihood()
    after = gp.fit_hyperparameters(isotropic=True)
    h = gp.get_hyperparameters()
    assert after > before + 10
    assert len(set(h["length_scales"])) == 1
    _, _, lml = exact_gp(X, y, X[:1], np.array(h["length_scales"]), h["signal_variance"],
                         h["noise"], "matern52")
    np.testing.assert_allclose(after, lml, rtol=1e-8)
    # ARD, started from the isotropic optimum, fits at least as well and splits the scales
    assert gp.fit_hyperparameters() >= after - 1e-9
    assert len(set(gp.get_hyperparameters()["length_scales"])) == 3


def test_a_repeated_point_raises_jitter_instead_of_failing():
    gp = LazyGP(2, noise=0.0)     # no noise: a repeated point makes K singular
    gp.add([0.5, 0.5], 1.0)
    gp.add([0.2, 0.9], 0.0)
    gp.add([0.5, 0.5], 1.0)
    gp.add([0.5, 0.5], 1.0)
    mu, std = gp.predict(np.array([[0.5, 0.5], [0.1, 0.1]]))
    assert np.all(np.isfinite(mu)) and np.all(np.isfinite(std))
    assert gp.jitter > 0 and abs(mu[0] - 1.0) < 1e-3
    np.testing.assert_allclose(gp.factor() @ gp.factor().T, gp.covariance(), atol=1e-10)


# ---- the oracles through Keras Tuner tuners ------------------------------------------------

def analytic(tuner_class):
    """``tuner_class`` whose trials return Branin at their values (no model, no training)."""
    class Analytic(tuner_class):
        def run_trial(self, trial, *args, **kwargs):
            hp = trial.hyperparameters
            return branin(hp.get("x1"), hp.get("x2"))
    return Analytic


def best_of(tuner):
    return tuner.oracle.get_best_trials(1)[0].score


def random_best(budget, seed, tmp_path):
    tuner = analytic(kt.RandomSearch)(max_trials=budget, seed=seed, hyperparameters=branin_space(),
                                      directory=str(tmp_path), project_name="random")
    tuner.search(verbose=0)
    return best_of(tuner)


def test_lazy_bayesian_search_finds_the_branin_minimum(tmp_path):
    budget = 40
    tuner = analytic(LazyBayesianSearch)(max_trials=budget, seed=7, hyperparameters=branin_space(),
                                         refit_until=0, isotropic_until=0,
                                         directory=str(tmp_path), project_name="lazy")
    # refits every lag (20) only, ARD (one isotropic fit at 6 kept for 20 results: 0.481)
    tuner.search(verbose=0)
    assert len(tuner.oracle.trials) == budget
    best = best_of(tuner)
    assert BRANIN_MIN <= best <= BRANIN_MIN + 0.05, best      # 0.424 measured
    # Random search with the same budget and seed is far off (0.896; it shares the 6 first points)
    assert random_best(budget, 7, tmp_path) > BRANIN_MIN + 0.3
    # the GP saw every result: refits at 6 (the initial points), 26; lazy adds in between
    gp = tuner.oracle.gp
    assert gp.n == budget - 1 and gp.stats["refits"] == 2
    assert gp.stats["refactorisations"] == 2


def test_small_gps_are_refitted_at_every_observation_then_every_lag(tmp_path):
    oracle = make_oracle(LazyBayesianOracle, tmp_path, max_trials=40, seed=7,
                         num_initial_points=6, lag=8, refit_until=12)
    run(oracle, 31)
    oracle.create_trial("driver")   # the GP catches up with the 31 results
    gp = oracle.gp
    # refits at 6, 7, ..., 12 (every observation), then 20 and 28 (every lag); adds lazy
    assert gp.n == 31 and gp.stats["refits"] == 7 + 2, gp.stats
    assert gp.stats["adds"] == 31 and gp.stats["refactorisations"] == 9


def test_small_gps_get_one_length_scale_then_one_per_input(tmp_path):
    oracle = make_oracle(LazyBayesianOracle, tmp_path, max_trials=40, seed=7,
                         num_initial_points=6, isotropic_until=12)
    run(oracle, 12)
    trial = oracle.create_trial("driver")   # the GP catches up with the 12 results
    assert oracle.gp.n == 12 and len(set(oracle.gp.length_scales)) == 1
    finish(oracle, trial)
    oracle.create_trial("driver")
    assert oracle.gp.n == 13 and len(set(oracle.gp.length_scales)) == 2


def hartmann6(x):
    a = np.array([[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14],
                  [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]])
    p = np.array([[0.1312, 0.1696, 0.5569, 0.0124, 0.8283, 0.5886],
                  [0.2329, 0.4135, 0.8307, 0.3736, 0.1004, 0.9991],
                  [0.2348, 0.1451, 0.3522, 0.2883, 0.3047, 0.6650],
                  [0.4047, 0.8828, 0.8732, 0.5743, 0.1091, 0.0381]])
    return -float(np.array([1.0, 1.2, 3.0, 3.2]) @ np.exp(-(a * (x - p) ** 2).sum(1)))


def hartmann6_best(tmp_path, budget, seed=1, **options):
    space = kt.HyperParameters()
    for i in range(6):
        space.Float("x%d" % i, 0.0, 1.0)
    oracle = LazyBayesianOracle(objective=kt.Objective("score", "min"), hyperparameters=space,
                                max_trials=budget, seed=seed, **options)
    _compat.set_oracle_project_dir(oracle, str(tmp_path), "h6-%s" % options)
    oracle.verbose = 0
    for _ in range(budget):
        trial = oracle.create_trial("driver")
        value = hartmann6(np.array([trial.hyperparameters.values["x%d" % i] for i in range(6)]))
        oracle.update_trial(trial.trial_id, {"score": value})
        trial.status = "COMPLETED"
        oracle.end_trial(trial)
    return oracle.get_best_trials(1)[0].score


def test_refitting_while_small_finds_more_of_hartmann6_in_40_evaluations(tmp_path):
    # minimum -3.322. With the old defaults (UCB, 18 random points, then 22 proposals):
    # refitted at every result -3.09; refitted once (at 18, then every lag = 20,
    # refit_until=0) -1.66 on this seed (measured). Now 10 random points, EI: -3.19
    assert hartmann6_best(tmp_path, 40, seed=15839) < -2.8


def test_one_length_scale_while_small_finds_more_of_hartmann6_in_40_evaluations(tmp_path):
    # the worst of the benchmark's 10 seeds with ARD throughout (isotropic_until=0): -0.85;
    # one length scale up to 30 observations (the default, 5 x 6 inputs): -2.98 (measured
    # with UCB and 18 random points; later -2.43 there, the worst seed of the old defaults);
    # with expected improvement (xi = 0) after 10 random points, the defaults now: -3.285
    assert hartmann6_best(tmp_path, 40, seed=1 + 7919 * 9) < -2.5


def test_genetic_search_improves_on_random_search(tmp_path):
    budget = 60
    tuner = analytic(GeneticSearch)(max_trials=budget, population_size=8, seed=7,
                                    hyperparameters=branin_space(), directory=str(tmp_path),
                                    project_name="genetic")
    tuner.search(verbose=0)
    best = best_of(tuner)
    assert best <= BRANIN_MIN + 0.1, best                     # 0.452 measured
    assert random_best(budget, 7, tmp_path) > BRANIN_MIN + 0.3   # 0.896 measured


def mixed_space_tuner(base):
    """A tuner whose run_trial declares every hyperparameter type, as a hypermodel would."""
    seen = []

    class Mixed(base):
        def run_trial(self, trial, *args, **kwargs):
            hp = trial.hyperparameters
            layers = hp.Int("layers", 1, 7, step=2)
            units = hp.Int("units", 4, 256, sampling="log")
            lr = hp.Float("lr", 1e-5, 1e-1, sampling="log")
            momentum = hp.Float("momentum", 0.0, 0.9, step=0.1)
            batchnorm = hp.Boolean("batchnorm")
            seed = hp.Fixed("seed", 42)
            kind = hp.Choice("kind", ["dense", "conv"])
            with hp.conditional_scope("kind", "dense"):
                width = hp.Int("width", 8, 64) if kind == "dense" else None
            with hp.conditional_scope("kind", "conv"):
                kernel = hp.Choice("kernel", [3, 5, 7]) if kind == "conv" else None
            seen.append(dict(hp.values))
            loss = (abs(math.log10(lr) + 3) + abs(layers - 3) + abs(math.log2(units) - 5)
                    + momentum + (0.5 if batchnorm else 0) + (0 if kind == "dense" else 1)
                    + (abs(width - 32) / 32 if width else 0) + (kernel or 0) / 10 + seed * 0)
            return loss

    return Mixed, seen


@pytest.mark.parametrize("base,options", [
    (LazyBayesianSearch, dict(num_initial_points=4, lag=8)),
    (GeneticSearch, dict(population_size=4, elitism=1)),
])
def test_every_hyperparameter_type_and_conditional_scopes(tmp_path, base, options):
    tuner_class, seen = mixed_space_tuner(base)
    tuner = tuner_class(max_trials=16, seed=11, directory=str(tmp_path), **options)
    tuner.search(verbose=0)
    assert len(seen) == 16
    space = {hp.name: hp for hp in tuner.oracle.get_space().space}
    assert set(space) == {"layers", "units", "lr", "momentum", "batchnorm", "seed", "kind",
                          "width", "kernel"}
    for values in seen[1:]:          # the first trial ran the defaults, declaring the space
        assert values["layers"] in (1, 3, 5, 7)
        assert 4 <= values["units"] <= 256 and isinstance(values["units"], int)
        assert 1e-5 <= values["lr"] <= 1e-1
        assert min(abs(values["momentum"] - i / 10) for i in range(10)) < 1e-9
        assert values["seed"] == 42 and isinstance(values["batchnorm"], bool)
        # conditional scopes: exactly the active one is set
        assert ("width" in values) == (values["kind"] == "dense")
        assert ("kernel" in values) == (values["kind"] == "conv")
        if "width" in values:
            assert 8 <= values["width"] <= 64
        if "kernel" in values:
            assert values["kernel"] in (3, 5, 7)
    later = seen[8:]   # past the random start: children / GP proposals
    assert {v["kind"] for v in later} == {"dense", "conv"} or len({v["lr"] for v in later}) > 5
    assert len({tuple(sorted(v.items())) for v in seen}) == len(seen)   # no duplicates
    assert tuner.oracle.get_best_trials(1)[0].score < min(
        t.score for t in list(tuner.oracle.trials.values())[:4])


# ---- the oracles driven directly -----------------------------------------------------------

def make_oracle(cls, tmp_path, name="search", **options):
    oracle = cls(objective=kt.Objective("score", "min"), hyperparameters=branin_space(), **options)
    _compat.set_oracle_project_dir(oracle, str(tmp_path), name)
    oracle.verbose = 0
    return oracle


def finish(oracle, trial):
    values = trial.hyperparameters.values
    oracle.update_trial(trial.trial_id, {"score": branin(values["x1"], values["x2"])})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)
    oracle.save()   # as a tuner does after end_trial (which saves with the trial still running)


def run(oracle, count):
    for _ in range(count):
        finish(oracle, oracle.create_trial("driver"))


@pytest.mark.parametrize("cls,options", [
    (LazyBayesianOracle, dict(num_initial_points=5)),
    (GeneticOracle, dict(population_size=6)),
])
def test_concurrent_trials_get_different_points(tmp_path, cls, options):
    oracle = make_oracle(cls, tmp_path, max_trials=40, seed=5, **options)
    run(oracle, 12)
    trials = [oracle.create_trial("group-%d" % g) for g in range(4)]   # none ended yet
    assert len({t.trial_id for t in trials}) == 4
    points = np.array([_unit_cube.to_vector(oracle.hyperparameters.space, t.hyperparameters)
                       for t in trials])
    distances = np.linalg.norm(points[:, None] - points[None, :], axis=-1)
    assert distances[np.triu_indices(4, 1)].min() > 0.01, distances


def test_constant_liar_spreads_concurrent_proposals(tmp_path):
    """Without the fantasised results, four groups asking at once would crowd one spot.

    Measured (15 results, 4 asking at once): seeds 6, 7, 8 spread 0.53, 0.26, 0.21
    with the liar and 0.000 without (one spot); seed 5 is an exception, 0.21 vs
    0.19 (there the next-best candidates after the first lie far apart anyway).
    """
    spreads = {}
    for liar in ("mean", None):
        oracle = make_oracle(LazyBayesianOracle, tmp_path, name=str(liar), max_trials=40, seed=6,
                             num_initial_points=5)
        run(oracle, 15)
        if liar is None:
            oracle.ongoing_trials = _NoPending()
        trials = [oracle.create_trial("group-%d" % g) for g in range(4)]
        points = np.array([_unit_cube.to_vector(oracle.hyperparameters.space, t.hyperparameters)
                           for t in trials])
        spreads[liar] = np.linalg.norm(points - points.mean(0), axis=1).mean()
    assert spreads["mean"] > 3 * spreads[None], spreads


class _NoPending(dict):
    """An ``ongoing_trials`` that hides the running trials from populate_space."""

    def values(self):
        return []


@pytest.mark.parametrize("cls,options", [
    (LazyBayesianOracle, dict(num_initial_points=5, lag=4)),
    (GeneticOracle, dict(population_size=6, islands=2, migration_interval=4)),
])
def test_a_reloaded_oracle_proposes_what_the_original_would(tmp_path, cls, options):
    original = make_oracle(cls, tmp_path, max_trials=40, seed=9, **options)
    run(original, 17)
    resumed = make_oracle(cls, tmp_path, max_trials=40, seed=1234, **options)
    resumed.reload()
    assert resumed.seed == 9 and len(resumed.trials) == 17
    if cls is GeneticOracle:
        assert resumed.populations == original.populations
        assert resumed.migrations == original.migrations == 4
    for _ in range(3):   # the next proposals, and the ones after them
        a, b = original.create_trial("driver"), resumed.create_trial("driver")
        assert a.trial_id == b.trial_id
        assert a.hyperparameters.values == b.hyperparameters.values
        finish(original, a)
        finish(resumed, b)
    if cls is LazyBayesianOracle:
        np.testing.assert_array_equal(resumed.gp.factor(), original.gp.factor())
        assert resumed.gp.get_hyperparameters() == original.gp.get_hyperparameters()


def test_a_tuner_resumes_a_search_from_its_directory(tmp_path):
    tuner_class = analytic(LazyBayesianSearch)
    first = tuner_class(max_trials=10, seed=2, hyperparameters=branin_space(),
                        directory=str(tmp_path), project_name="p")
    first.search(verbose=0)
    again = tuner_class(max_trials=16, seed=2, hyperparameters=branin_space(),
                        directory=str(tmp_path), project_name="p", overwrite=False)
    again.search(verbose=0)
    assert len(again.oracle.trials) == 16
    assert best_of(again) <= best_of(first)
    assert again.oracle.gp.n == 15   # replayed the first 10 results, added 5 more


@pytest.mark.parametrize("elitism", [2, 0])
def test_elitism_keeps_the_best(tmp_path, elitism):
    oracle = make_oracle(GeneticOracle, tmp_path, max_trials=60, seed=4, population_size=5,
                         elitism=elitism)
    kept = []
    for _ in range(60):
        finish(oracle, oracle.create_trial("driver"))
        best = oracle.get_best_trials(1)[0].trial_id
        population = oracle.populations[0]
        assert len(population) <= 5
        kept.append(best in population)
    if elitism:
        assert all(kept)
    else:   # aging alone: every member is replaced after five newer ones
        assert not all(kept)


def test_islands_evolve_apart_and_migrate(tmp_path):
    oracle = make_oracle(GeneticOracle, tmp_path, max_trials=40, seed=6, population_size=8,
                         islands=2, migration_interval=6, elitism=1)
    run(oracle, 5)
    populations = oracle.populations
    assert populations == [["00", "02", "04"], ["01", "03"]]   # trial k on island k mod 2
    run(oracle, 1)
    assert oracle.migrations == 1
    bests = [min(ids, key=lambda t: oracle.trials[t].score) for ids in (
        ["00", "02", "04"], ["01", "03", "05"])]
    after = oracle.populations
    assert bests[0] in after[1] and bests[1] in after[0]
    run(oracle, 12)
    assert oracle.migrations == 3
    children = [t for t in oracle.trials if int(t) >= 8]
    assert children, "no child was proposed"


def test_oracles_reject_bad_options():
    with pytest.raises(ValueError, match="acquisition"):
        LazyBayesianOracle(acquisition="pi")
    with pytest.raises(ValueError, match="lag"):
        LazyBayesianOracle(lag=0)
    with pytest.raises(ValueError, match="refit_until"):
        LazyBayesianOracle(refit_until=-1)
    with pytest.raises(ValueError, match="elitism"):
        GeneticOracle(population_size=4, islands=2, elitism=2)
    with pytest.raises(ValueError, match="mutation_rate"):
        GeneticOracle(mutation_rate=1.5)


def test_expected_improvement_also_finds_the_branin_minimum(tmp_path):
    oracle = make_oracle(LazyBayesianOracle, tmp_path, max_trials=30, seed=7, acquisition="ei")
    run(oracle, 30)
    assert oracle.get_best_trials(1)[0].score <= BRANIN_MIN + 0.1


# ---- pending and failed trials -------------------------------------------------------------

def simulate_workers(oracle, budget, workers, seed=0):
    """Best value after ``budget`` evaluations by ``workers`` asynchronous groups (simulated).

    As the service runs them: every group holds one trial; the first to finish
    (durations drawn from [0.5, 1.5]) reports it and asks for its next trial
    while the other groups' trials are still running.
    """
    import heapq

    rng = np.random.default_rng(seed)
    running, now, best = [], 0.0, math.inf

    def start(group):
        trial = oracle.create_trial("group-%d" % group)
        if trial.status == "RUNNING":
            heapq.heappush(running, (now + rng.uniform(0.5, 1.5), group, trial))

    for group in range(workers):
        start(group)
    while running:
        now, group, trial = heapq.heappop(running)
        values = trial.hyperparameters.values
        best = min(best, branin(values["x1"], values["x2"]))
        finish(oracle, trial)
        start(group)
    assert len(oracle.end_order) == budget
    return best


def test_four_asynchronous_workers_find_what_one_finds_on_branin(tmp_path):
    # each proposal is made while the 3 other groups' trials run. Measured on this seed:
    # one worker 0.3982; four 0.3991 (UCB, kappa 2.6). Before: four 0.896 (a constant liar
    # at the results' mean made the best point's neighbourhood look average, and 9 random
    # points, not 6)
    budget = 30
    one = simulate_workers(make_oracle(LazyBayesianOracle, tmp_path, name="one",
                                       max_trials=budget, seed=7), budget, 1)
    four = simulate_workers(make_oracle(LazyBayesianOracle, tmp_path, name="four",
                                        max_trials=budget, seed=7), budget, 4)
    assert one <= BRANIN_MIN + 0.01, one
    assert four <= BRANIN_MIN + 0.02, (four, one)


def test_a_proposal_is_not_a_running_trial(tmp_path):
    oracle = make_oracle(LazyBayesianOracle, tmp_path, max_trials=40, seed=3)
    run(oracle, 12)
    space = oracle.hyperparameters.space
    pending = []
    for group in range(4):
        trial = oracle.create_trial("group-%d" % group)
        point = _unit_cube.to_vector(space, trial.hyperparameters)
        for other in pending:
            assert np.linalg.norm(point - other) > 0.01, (point, pending)
        pending.append(point)


@pytest.mark.parametrize("outcome", ["FAILED", "nan", "inf"])
def test_a_failed_point_is_not_proposed_again(tmp_path, outcome):
    """A trial that ends without a usable result is a point the search leaves alone.

    Before, the GP never heard of it and proposed the same optimum of the
    acquisition again and again (17 trials in a row at one failing point).
    """
    oracle = make_oracle(LazyBayesianOracle, tmp_path, max_trials=40, seed=5,
                         max_consecutive_failed_trials=None)
    run(oracle, 12)
    space = oracle.hyperparameters.space
    failed = []
    for _ in range(5):
        trial = oracle.create_trial("driver")
        failed.append(_unit_cube.to_vector(space, trial.hyperparameters))
        if outcome == "FAILED":
            trial.status = "FAILED"
            trial.message = "the objective raised"
        else:
            oracle.update_trial(trial.trial_id, {"score": float(outcome)})
            trial.status = "COMPLETED"
        oracle.end_trial(trial)
        oracle.save()
    failed.append(_unit_cube.to_vector(space, oracle.create_trial("driver").hyperparameters))
    failed = np.array(failed)
    distances = np.linalg.norm(failed[:, None] - failed[None, :], axis=-1)
    assert distances[np.triu_indices(len(failed), 1)].min() > 0.05, distances
    # the failures are fantasies at each proposal, not the GP's data
    assert oracle.gp.n == 12 and len(oracle._gp_failed) == 5


def test_a_running_trial_believed_better_than_the_best_is_the_incumbent(tmp_path):
    """Kriging believer: the fantasised results count as results for the incumbent too.

    Expected improvement is measured from the best of the results and of the
    fantasies. From the best result alone, a running trial that the GP expects to
    beat it keeps the spot right beside it attractive (its improvement is still
    counted), so the next group's proposal went there. Hartmann-6 at 40 evaluations,
    4 simulated workers, 20 seeds (benchmarks/hpo.py's and the next 10): median
    (mean) best -3.169 (-3.092) from the best result, -3.194 (-3.157) from the
    fantasies too.
    """
    # The set-up needs a running trial that the GP believes better than the best result.
    # Which seed gives one depends on the BLAS kernel's rounding (seed 6 does with
    # OpenBLAS's Sandybridge kernel, not with its Haswell/Zen ones): take the first seed
    # that does; the property below is then checked as it stands.
    tried = []
    for seed in range(6, 26):
        oracle = make_oracle(LazyBayesianOracle, tmp_path / str(seed), max_trials=40,
                             seed=seed)
        run(oracle, 12)
        space = oracle.hyperparameters.space
        running = oracle.create_trial("group-0")
        best_result = min(t.score for t in oracle.trials.values() if t.status == "COMPLETED")
        oracle._sync_gp()
        believed = float(oracle.gp.predict(
            _unit_cube.to_vector(space, running.hyperparameters)[None, :], return_std=False)[0])
        tried.append((seed, believed, best_result))
        if believed < best_result - 0.01:
            break
    assert believed < best_result - 0.01, tried
    incumbents = []
    maximise = oracle._maximise_acquisition

    def spy(rng, best, seeds, starts=5):
        incumbents.append(best)
        return maximise(rng, best, seeds, starts)

    oracle._maximise_acquisition = spy
    oracle.create_trial("group-1")
    assert incumbents == [pytest.approx(believed, abs=1e-6)], (incumbents, best_result)
