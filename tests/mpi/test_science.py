"""matex.science under mpiexec: loss surfaces and Hessian spectra equal their one-process values.

References are computed on every rank without distribution: analytically
(a linear model with MSE has a known loss and Hessian) or by the same loss
code over all the data on a one-rank communicator (``MPI.COMM_SELF`` in a
slot). Runs at any rank count; the driver runs it on 2 and 3 ranks.
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

import matex
import matex.keras as keras
import matex.science as science
from matex import _runtime
from matex.science import _data, _objective
from matex.science._directions import random_directions

from helpers import gather

keras.config.set_floatx("float64")

N, D, M = 103, 5, 3   # rows (not a multiple of 2 or 3), inputs, outputs
RNG = np.random.default_rng(42)
X = RNG.standard_normal((N, D))
Y = X @ RNG.standard_normal((D, M)) + 0.3 * RNG.standard_normal((N, M))
TMP = os.environ.get("MATEX_TEST_REPORT_DIR", "/tmp")


def shared_path(name):
    """A file path every rank agrees on (under the report directory)."""
    return os.path.join(TMP, "science-%d-%s" % (matex.size(), name))


def linear_model():
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(M, name="out")])
    model.compile(loss="mse", optimizer="sgd")
    w = np.random.default_rng(1).standard_normal((D, M))
    model.set_weights([w, np.array([0.1, -0.2, 0.3])])
    return model


def mlp():
    model = keras.Sequential([keras.Input((D,)),
                              keras.layers.Dense(4, activation="tanh", name="hidden"),
                              keras.layers.Dense(M, name="out")])
    model.compile(loss="mse", optimizer="sgd")
    rng = np.random.default_rng(2)
    model.set_weights([0.5 * rng.standard_normal(w.shape) for w in model.get_weights()])
    return model


def linear_loss(w, b):
    return float(np.mean((X @ w + b - Y) ** 2))


def linear_hessian(features):
    """Hessian of mean((A W - Y)^2) over (W, b) flattened as Keras does (W row-major, then b)."""
    a = np.hstack([features, np.ones((len(features), 1))])
    block = 2.0 / (len(features) * M) * a.T @ a     # per output, over (W[:, k], b[k])
    d = features.shape[1]
    h = np.zeros(((d + 1) * M, (d + 1) * M))
    index = lambda i, k: i * M + k if i < d else d * M + k   # noqa: E731
    for k in range(M):
        for i in range(d + 1):
            for j in range(d + 1):
                h[index(i, k), index(j, k)] = block[i, j]
    return h


def one_process_loss(model, weights):
    """The loss at ``weights`` over all the data, computed by this rank alone."""
    comm = MPI.COMM_SELF.Dup()
    slot = _runtime.register_comm(comm)
    try:
        objective = _objective.Objective(model, _data.Share((X, Y), 0, 1, 32), comm=slot)
        saved = objective.get()
        objective.set(weights)
        value = objective.loss()
        objective.set(saved)
        return value
    finally:
        _runtime.release_comm(slot)
        comm.Free()


# ---- loss surfaces ------------------------------------------------------------

@pytest.mark.parametrize("per_point", ["one", "all"])
def test_surface_equals_analytic_one_process_values(per_point):
    model = linear_model()
    k = 1 if per_point == "one" else matex.size()
    path = shared_path("linear-%s.h5" % per_point)
    if matex.rank() == 0 and os.path.exists(path):
        os.remove(path)
    matex.comm().Barrier()
    surface = science.loss_surface(model, (X, Y), resolution=(5, 4), span=0.5, path=path,
                                   ranks_per_point=k, batch_size=16, verbose=0)
    assert surface.shape == (5, 4)
    stored = science.read_surface(path)
    np.testing.assert_array_equal(stored["loss"], surface)
    w, b = model.get_weights()
    expected = np.array([[linear_loss(w + x * stored["d1"][0] + y * stored["d2"][0],
                                      b + x * stored["d1"][1] + y * stored["d2"][1])
                          for y in stored["y"]] for x in stored["x"]])
    np.testing.assert_allclose(surface, expected, rtol=1e-12)
    # biases got zero directions (ignore="biasbn")
    assert not np.any(stored["d1"][1]) and not np.any(stored["d2"][1])
    # filter normalisation: each output's column of a direction has the weight column's norm
    np.testing.assert_allclose(np.linalg.norm(stored["d1"][0], axis=0),
                               np.linalg.norm(w, axis=0), rtol=1e-9)
    assert len({s.tobytes() for s in gather(surface)}) == 1
    np.testing.assert_array_equal(model.get_weights()[0], w)   # weights put back


def test_a_failure_on_rank_0_ends_every_group_without_a_hang(monkeypatch):
    """Rank 0 serves the point queue: when its own point raises, the other groups learn
    it at their next request and raise too (they used to wait for a next point forever)."""
    calls = []
    loss = _objective.Objective.loss

    def failing(self):
        calls.append(1)
        if matex.rank() == 0 and len(calls) == 2:
            raise FloatingPointError("injected on rank 0")
        return loss(self)

    monkeypatch.setattr(_objective.Objective, "loss", failing)
    expected = "injected on rank 0" if matex.rank() == 0 else "another rank group failed"
    with pytest.raises((FloatingPointError, RuntimeError), match=expected):
        science.loss_surface(linear_model(), (X, Y), resolution=(6, 6), ranks_per_point=1,
                             batch_size=16, verbose=0)
    matex.comm().Barrier()   # every rank got here: nobody waits


def test_surface_of_a_nonlinear_model_equals_one_process_loss_and_evaluate():
    model = mlp()
    weights = [v.numpy() for v in model.trainable_weights]
    surface = science.loss_surface(model, (X, Y), resolution=(3, 3), span=0.4,
                                   ranks_per_point=1, batch_size=10, verbose=0, seed=3)
    assert abs(surface[1, 1] - model.evaluate(X, Y, batch_size=7, verbose=0)) < 1e-12
    d1, d2 = random_directions(weights, 3)   # what "random" with seed=3 draws
    xs, ys = science.surface_axes((3, 3), 0.4)
    for i, j in [(0, 0), (2, 1), (1, 2)]:
        point = [w + xs[i] * a + ys[j] * b for w, a, b in zip(weights, d1, d2)]
        assert abs(surface[i, j] - one_process_loss(model, point)) < 1e-12


def test_interrupted_surface_resumes_to_the_uninterrupted_file():
    model = mlp()
    whole, part = shared_path("whole.h5"), shared_path("part.h5")
    if matex.rank() == 0:
        for p in (whole, part):
            if os.path.exists(p):
                os.remove(p)
    matex.comm().Barrier()
    kwargs = dict(resolution=(4, 5), span=0.3, batch_size=16, verbose=0,
                  ranks_per_point=matex.size() if matex.size() == 2 else 1)
    reference = science.loss_surface(model, (X, Y), path=whole, **kwargs)
    first = science.loss_surface(model, (X, Y), path=part, max_points=7, **kwargs)
    assert np.count_nonzero(np.isfinite(first)) == 7
    stored = science.read_surface(part)["loss"]
    assert np.count_nonzero(np.isnan(stored)) == 20 - 7   # unfilled points are NaN
    np.testing.assert_array_equal(first[np.isfinite(first)], reference[np.isfinite(first)])
    resumed = science.loss_surface(model, (X, Y), path=part, **kwargs)
    np.testing.assert_array_equal(resumed, reference)
    np.testing.assert_array_equal(science.read_surface(part)["loss"],
                                  science.read_surface(whole)["loss"])
    # a rerun with other settings is refused on every rank, and the file is kept
    with pytest.raises(ValueError, match="different settings"):
        science.loss_surface(model, (X, Y), path=part, **dict(kwargs, span=0.4))
    with pytest.raises(ValueError, match="different settings"):
        science.loss_surface(model, (X, Y), path=part, seed=5, **kwargs)
    np.testing.assert_array_equal(science.read_surface(part)["loss"], reference)


def test_given_directions_and_interpolation():
    model = linear_model()
    w, b = model.get_weights()
    d1 = [np.ones_like(w), np.zeros_like(b)]
    d2 = [np.zeros_like(w), np.ones_like(b)]
    surface = science.loss_surface(model, (X, Y), directions=(d1, d2), resolution=(3, 2),
                                   span=((0.0, 1.0), (-1.0, 0.0)), normalization=None,
                                   verbose=0)
    for i, x in enumerate([0.0, 0.5, 1.0]):
        for j, y in enumerate([-1.0, 0.0]):
            assert abs(surface[i, j] - linear_loss(w + x, b + y)) < 1e-12
    other = [w * 0.0, b * 0.0]
    alphas, losses = science.interpolate(model.get_weights(), other, (X, Y), points=5,
                                         model=model)
    for alpha, loss in zip(alphas, losses):
        assert abs(loss - linear_loss((1 - alpha) * w, (1 - alpha) * b)) < 1e-12
    second = linear_model()
    second.set_weights([2 * w, b - 1])
    alphas, losses = science.interpolate(model, second, (X, Y), alphas=[-0.5, 0.25, 1.5])
    for alpha, loss in zip(alphas, losses):
        assert abs(loss - linear_loss((1 + alpha) * w, b - alpha)) < 1e-12
    np.testing.assert_array_equal(model.get_weights()[0], w)


def test_bad_surface_input_raises_on_every_rank():
    model = linear_model()
    with pytest.raises(ValueError, match="at least 2"):
        science.loss_surface(model, (X, Y), resolution=(1, 5), verbose=0)
    w, b = model.get_weights()
    with pytest.raises(ValueError, match="shape"):
        science.loss_surface(model, (X, Y), directions=([w.T, b], [w, b]), verbose=0)
    with pytest.raises(ValueError, match="arrays"):
        science.loss_surface(model, (X, Y), directions=([w], [w, b]), verbose=0)
    uncompiled = keras.Sequential([keras.Input((D,)), keras.layers.Dense(M)])
    with pytest.raises(ValueError, match="not compiled"):
        science.loss_surface(uncompiled, (X, Y), verbose=0)
    frozen = keras.Sequential([keras.Input((D,)), keras.layers.Dense(M, trainable=False)])
    frozen.compile(loss="mse")
    with pytest.raises(ValueError, match="no trainable weights"):
        science.loss_surface(frozen, (X, Y), verbose=0)
    if matex.size() > 1:
        with pytest.raises(ValueError, match="divides"):
            science.loss_surface(model, (X, Y), ranks_per_point=matex.size() + 1, verbose=0)
    # rank 0 cannot create the file: one ValueError on every rank (before, rank 0 raised
    # a NotADirectoryError and the other ranks waited for its verdict forever)
    with pytest.raises(ValueError, match=r"/dev/null/surface.h5: rank 0: NotADirectoryError"):
        science.loss_surface(model, (X, Y), resolution=(2, 2), path="/dev/null/surface.h5",
                             verbose=0)


# ---- Hessians -------------------------------------------------------------------

def test_top_eigenvalues_of_a_known_hessian():
    model = linear_model()
    exact = np.sort(np.linalg.eigvalsh(linear_hessian(X)))[::-1]
    values, vectors = science.hessian_eigenvalues(model, (X, Y), top_k=5, batch_size=20,
                                                  return_vectors=True)
    np.testing.assert_allclose(values, exact[:5], rtol=1e-6, atol=1e-9)
    assert values[0] == pytest.approx(values[2], rel=1e-6)   # multiplicity M found
    h = linear_hessian(X)
    for value, vector in zip(values, vectors):
        flat = np.concatenate([a.reshape(-1) for a in vector])
        np.testing.assert_allclose(h @ flat, value * flat, atol=1e-6 * exact[0])
    assert len({v.tobytes() for v in gather(values)}) == 1
    # the whole spectrum (top_k = parameter count)
    everything = science.hessian_eigenvalues(model, (X, Y), top_k=(D + 1) * M)
    np.testing.assert_allclose(everything, exact, rtol=1e-6, atol=1e-9)


def test_eigenvalues_of_one_layer():
    model = mlp()
    hidden_w, hidden_b = model.get_layer("hidden").get_weights()
    exact = np.sort(np.linalg.eigvalsh(linear_hessian(np.tanh(X @ hidden_w + hidden_b))))[::-1]
    values = science.hessian_eigenvalues(model, (X, Y), top_k=3, layers=["out"])
    np.testing.assert_allclose(values, exact[:3], rtol=1e-6)


def test_density_and_trace():
    model = linear_model()
    h = linear_hessian(X)
    n = h.shape[0]
    density = science.hessian_density(model, (X, Y), n_vectors=6, n_steps=n, seed=4)
    grid, values = density
    assert abs(np.trapezoid(values, grid) - 1.0) < 1e-3
    np.testing.assert_allclose(density.weights.sum(axis=1), 1.0, rtol=1e-9)
    mean = float(np.sum(density.nodes * density.weights) / 6)
    trace = science.hessian_trace(model, (X, Y), n_samples=6, seed=4)
    assert mean * n == pytest.approx(trace, rel=1e-9)   # the same Rademacher vectors
    exact_trace = float(np.trace(h))
    assert trace == pytest.approx(exact_trace, rel=0.25)
    long_run = science.hessian_trace(model, (X, Y), n_samples=300, seed=5)
    assert long_run == pytest.approx(exact_trace, rel=0.05)
    assert density.nodes.max() == pytest.approx(np.linalg.eigvalsh(h)[-1], rel=1e-6)
    assert len({values.tobytes() for values in gather(values)}) == 1


def test_bad_hessian_input_raises_on_every_rank():
    model = linear_model()
    with pytest.raises(ValueError, match="more than the 18 parameters"):
        science.hessian_eigenvalues(model, (X, Y), top_k=19)
    with pytest.raises(ValueError, match="no layer"):
        science.hessian_eigenvalues(model, (X, Y), top_k=1, layers=["nope"])
    uncompiled = keras.Sequential([keras.Input((D,)), keras.layers.Dense(M)])
    with pytest.raises(ValueError, match="not compiled"):
        science.hessian_trace(uncompiled, (X, Y))


def test_trajectory_pca_surface_and_plot():
    model = mlp()
    traj_path = shared_path("trajectory.h5")
    recorder = science.TrajectoryRecorder(traj_path)
    model.fit(X, Y, epochs=4, batch_size=16, verbose=0, callbacks=[recorder])
    count = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    assert recorder.weights.shape == (5, count)
    final = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_weights])
    np.testing.assert_allclose(recorder.weights[-1], final, rtol=1e-6)
    matex.comm().Barrier()
    np.testing.assert_array_equal(science.load_trajectory(traj_path), recorder.weights)
    path = shared_path("pca.h5")
    if matex.rank() == 0 and os.path.exists(path):
        os.remove(path)
    matex.comm().Barrier()
    surface = science.loss_surface(model, (X, Y), directions="pca", trajectory=recorder,
                                   resolution=(5, 5), span=2.0, path=path, verbose=0)
    assert abs(surface[2, 2] - model.evaluate(X, Y, verbose=0)) < 1e-12
    stored = science.read_surface(path)
    d1 = np.concatenate([a.reshape(-1) for a in stored["d1"]])
    d2 = np.concatenate([a.reshape(-1) for a in stored["d2"]])
    assert abs(d1 @ d1 - 1) < 1e-9 and abs(d1 @ d2) < 1e-9   # PCA: orthonormal, not rescaled
    np.testing.assert_allclose(stored["trajectory"][-1], 0.0, atol=1e-6)
    np.testing.assert_allclose(stored["trajectory"],
                               science.project_trajectory(recorder, [d1, d2]), atol=1e-6)
    if matex.rank() == 0:
        import matplotlib.image

        png = science.plot_surface(path, shared_path("pca.png"))
        image = matplotlib.image.imread(png)
        assert image.shape[:2] == (320, 400) and image[..., :3].std() > 0.05


def test_datasets_of_global_batches_and_of_shares():
    import tensorflow as tf

    model = linear_model()
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(20)
    exact = np.sort(np.linalg.eigvalsh(linear_hessian(X)))[::-1]
    np.testing.assert_allclose(science.hessian_eigenvalues(model, dataset, top_k=2), exact[:2],
                               rtol=1e-6)
    from_arrays = science.loss_surface(model, (X, Y), resolution=(3, 3), verbose=0)
    from_dataset = science.loss_surface(model, dataset, resolution=(3, 3), verbose=0)
    np.testing.assert_allclose(from_dataset, from_arrays, rtol=1e-12)
    share = matex.shard(dataset)   # this rank's share already: only whole-job groups
    np.testing.assert_allclose(science.hessian_eigenvalues(model, share, top_k=2), exact[:2],
                               rtol=1e-6)
    np.testing.assert_allclose(
        science.loss_surface(model, share, resolution=(3, 3), ranks_per_point=matex.size(),
                             verbose=0), from_arrays, rtol=1e-12)
    if matex.size() > 1:
        with pytest.raises(ValueError, match="already holds one rank's share"):
            science.loss_surface(model, share, resolution=(3, 3), verbose=0)
