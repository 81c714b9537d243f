"""matex.science's one-process parts: Lanczos, directions, PCA, projections, plots."""

import os

import numpy as np
import pytest

from matex.science import _directions, _lanczos, _plots


def _symmetric(n, seed, repeat=None):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    values = rng.uniform(-1, 5, n)
    if repeat:
        values[:repeat] = values.max() + 1.0   # the top eigenvalue, `repeat` times
    return (q * values) @ q.T, np.sort(values)[::-1]


def test_lanczos_finds_the_spectrum_with_multiplicities():
    a, exact = _symmetric(30, 0, repeat=3)
    rng = np.random.default_rng(1)
    alpha, beta, basis = _lanczos.lanczos(lambda v: a @ v, rng.standard_normal(30), 30, rng)
    values, vectors = _lanczos.ritz(alpha, beta)
    np.testing.assert_allclose(np.sort(values)[::-1], exact, atol=1e-10)
    np.testing.assert_allclose(basis @ basis.T, np.eye(30), atol=1e-10)   # reorthogonalised
    ritz_vectors = basis.T @ vectors
    np.testing.assert_allclose(a @ ritz_vectors, ritz_vectors * values, atol=1e-9)
    assert np.sum(np.abs(values - exact[0]) < 1e-9) == 3
    # without a restart generator it stops at the invariant subspace (no third copy)
    alpha, beta, _ = _lanczos.lanczos(lambda v: a @ v, rng.standard_normal(30), 30)
    assert alpha.size < 30


def test_lanczos_top_values_converge_before_the_dimension():
    a, exact = _symmetric(200, 2)
    rng = np.random.default_rng(3)
    alpha, beta, _ = _lanczos.lanczos(lambda v: a @ v, rng.standard_normal(200), 120, rng)
    values = np.sort(_lanczos.ritz(alpha, beta)[0])[::-1]
    np.testing.assert_allclose(values[:3], exact[:3], rtol=1e-6)


def test_filter_normalisation():
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((3, 3, 2, 4)), rng.standard_normal(4),
               rng.standard_normal((8, 5))]
    d1, _ = _directions.random_directions(weights, seed=7)
    again, _ = _directions.random_directions(weights, seed=7)
    for a, b in zip(d1, again):
        np.testing.assert_array_equal(a, b)   # the seed alone decides: equal on every rank
    for d, w in ((d1[0], weights[0]), (d1[2], weights[2])):
        axes = tuple(range(d.ndim - 1))
        np.testing.assert_allclose(np.sqrt((d ** 2).sum(axes)), np.sqrt((w ** 2).sum(axes)),
                                   rtol=1e-9)
    assert not np.any(d1[1])
    copied = _directions.filter_normalize(d1, weights, ignore=None)
    np.testing.assert_array_equal(copied[1], weights[1])
    raw, _ = _directions.random_directions(weights, seed=7, normalization=None)
    assert np.any(raw[1])
    with pytest.raises(ValueError, match="normalization"):
        _directions.random_directions(weights, normalization="layer")
    with pytest.raises(ValueError, match="shape"):
        _directions.check_shapes([np.zeros((5, 8)), np.zeros(4), np.zeros((8, 5))],
                                 [np.zeros((3, 3, 2, 4)), np.zeros(4), np.zeros((8, 5))])


def test_pca_directions_and_projection():
    rng = np.random.default_rng(0)
    final = rng.standard_normal(50)
    u, v = np.eye(50)[0], np.eye(50)[1]
    t = np.linspace(1, 0, 12)
    trajectory = final + np.outer(3 * t ** 2, u) + np.outer(t, v)
    d1, d2, coords, explained = _directions.pca_directions(trajectory)
    assert abs(d1 @ d2) < 1e-12 and abs(d1 @ d1 - 1) < 1e-12
    assert explained.sum() == pytest.approx(1.0)   # the path lies in a plane
    np.testing.assert_allclose(coords[-1], 0.0, atol=1e-12)
    back = final + coords @ np.stack([d1, d2])
    np.testing.assert_allclose(back, trajectory, atol=1e-10)
    np.testing.assert_allclose(_directions.project(trajectory, [d1, d2], final), coords,
                               atol=1e-10)
    with pytest.raises(ValueError, match="at least 3"):
        _directions.pca_directions(trajectory[:2])


def _image(path):
    import matplotlib.image

    return matplotlib.image.imread(path)


def test_plots(tmp_path):
    x = np.linspace(-1, 1, 9)
    surface = 1.0 + x[:, None] ** 2 + 2 * x[None, :] ** 2
    contour = _plots.plot_surface(surface, str(tmp_path / "c.png"),
                                  trajectory=np.array([[0.8, 0.8], [0.3, 0.2], [0.0, 0.0]]))
    three_d = _plots.plot_surface(surface, str(tmp_path / "s.png"), kind="3d", log=True)
    density = _plots.plot_density((np.linspace(0, 1, 50), np.exp(-np.linspace(0, 1, 50))),
                                  str(tmp_path / "d.png"))
    for path in (contour, three_d, density):
        image = _image(path)
        assert os.path.getsize(path) > 5000
        assert image.shape[0] >= 250 and image.shape[1] >= 350
        assert image[..., :3].std() > 0.05   # drawn, not blank
    # the contour map is drawn where the surface is: blue-ish low centre differs from edges
    with pytest.raises(ValueError, match="kind"):
        _plots.plot_surface(surface, str(tmp_path / "x.png"), kind="pie")
