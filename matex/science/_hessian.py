"""Hessian spectra of the compiled loss over all the data: top eigenvalues, density, trace.

Every function is collective over MaTEx's ranks: each rank holds a share of
the data (``_data``), a Hessian-vector product is computed on every share by
double backprop and summed with one allreduce (``_objective.Objective.hvp``),
so the operator is the Hessian of the global loss. Random vectors come from
``seed`` and are the same on every rank, and so is everything computed from
the products; the result is the same on every rank.

* ``hessian_eigenvalues``: Lanczos with full reorthogonalisation (``_lanczos``),
  restarted when the Krylov space is exhausted (multiplicities).
* ``hessian_density``: stochastic Lanczos quadrature (Ubaru, Chen and Saad
  2017; Ghorbani et al. 2019): per random vector, the Ritz values (nodes) and
  the squared first components of their eigenvectors (weights, summing to 1)
  of ``n_steps`` Lanczos steps; the density is their average smoothed by a
  Gaussian kernel.
* ``hessian_trace``: Hutchinson's estimator with Rademacher vectors.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from matex import _runtime
from matex.science import _data, _lanczos, _objective

if TYPE_CHECKING:
    import keras

PROGRESS_SECONDS = 5.0


def _objective_for(model, data, layers, batch_size):
    _objective.check_model(model)
    variables = _objective.select_variables(model, layers)
    share = _data.Share(data, _runtime.rank(), _runtime.size(), batch_size, whole_job=True)
    return _objective.Objective(model, share, comm=0, variables=variables)


def _check_count(value, name, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError("matex.science: %s must be a whole number >= %d, not %r"
                         % (name, minimum, value))
    return int(value)


class _Progress:
    """Counts Hessian-vector products; a line on rank 0 every few seconds when verbose."""

    def __init__(self, objective, total, what, verbose):
        self.objective, self.total, self.what = objective, total, what
        self.verbose = verbose and _runtime.rank() == 0
        self.count = 0
        self.start = self.last = time.monotonic()

    def __call__(self, vector):
        product = self.objective.hvp(vector)
        self.count += 1
        now = time.monotonic()
        if self.verbose and (now - self.last > PROGRESS_SECONDS or self.count == self.total):
            self.last = now
            print("matex.science: %s: %d/%d Hessian-vector products, %.2f/s"
                  % (self.what, self.count, self.total, self.count / max(now - self.start, 1e-9)),
                  file=sys.stdout, flush=True)
        return product


def hessian_eigenvalues(model: keras.Model, data: Any, top_k: int = 1, *,
                        layers: Sequence[str] | None = None, n_steps: int | None = None,
                        seed: int = 0, batch_size: int = 256, return_vectors: bool = False,
                        verbose: int = 0) -> np.ndarray | tuple[np.ndarray, list]:
    """The ``top_k`` largest eigenvalues of the loss's Hessian over all ``data``, descending.

    Args:
      model: a compiled Keras model; the Hessian is taken at its current weights.
      data: ``(x, y[, sample_weight])`` global arrays or a ``tf.data.Dataset``
        (global batches, or this rank's share from ``matex.readers``).
      top_k: how many eigenvalues (at most the number of parameters).
      layers: names of layers whose weights the Hessian is over (default: all
        trainable weights).
      n_steps: Lanczos steps (default ``min(parameters, max(3*top_k, top_k + 30))``).
      seed: start vector's seed (the same on every rank).
      return_vectors: also return the Ritz vectors, each a list of arrays shaped
        like the selected weights.
    Returns:
      ``(top_k,)`` float64 array, or ``(values, vectors)``.
    """
    top_k = _check_count(top_k, "top_k")
    objective = _objective_for(model, data, layers, batch_size)
    n = objective.dimension
    if top_k > n:
        raise ValueError("matex.science: top_k=%d is more than the %d parameters the Hessian "
                         "is over" % (top_k, n))
    steps = min(n, max(3 * top_k, top_k + 30)) if n_steps is None else _check_count(
        n_steps, "n_steps")
    steps = max(steps, top_k)
    rng = np.random.default_rng(seed)
    product = _Progress(objective, steps, "Hessian eigenvalues", verbose)
    alpha, beta, basis = _lanczos.lanczos(product, rng.standard_normal(n), steps, rng)
    values, vectors = _lanczos.ritz(alpha, beta)
    order = np.argsort(values)[::-1][:top_k]
    top = values[order]
    if not return_vectors:
        return top
    flat = basis.T @ vectors[:, order]
    return top, [objective.unflatten(flat[:, i]) for i in range(top.size)]


@dataclasses.dataclass
class Density:
    """A Hessian spectral density from stochastic Lanczos quadrature.

    ``grid`` and ``density`` (the smoothed density, integrating to ~1 over the
    grid); ``nodes`` and ``weights``, ``(n_vectors, n_steps)``, the quadrature
    per random vector (weights sum to 1 per vector; ``sum(weights * nodes) /
    n_vectors`` estimates ``trace / parameters``); ``sigma``, the kernel width.
    Unpacks as ``grid, density = hessian_density(...)``.
    """

    grid: np.ndarray
    density: np.ndarray
    nodes: np.ndarray
    weights: np.ndarray
    sigma: float

    def __iter__(self):
        return iter((self.grid, self.density))


def hessian_density(model: keras.Model, data: Any, n_vectors: int = 8, n_steps: int = 40, *,
                    layers: Sequence[str] | None = None,
                    seed: int = 0, sigma: float | None = None, grid_points: int = 1000,
                    batch_size: int = 256, verbose: int = 0) -> Density:
    """Spectral density of the loss's Hessian by stochastic Lanczos quadrature.

    ``n_vectors`` Rademacher start vectors (from ``seed``), ``n_steps`` Lanczos
    steps each (at most the number of parameters; fewer when the Krylov space
    is exhausted, the missing nodes then get weight 0). ``sigma``: the
    Gaussian kernel's width (default 1% of the spectrum's extent).
    """
    n_vectors = _check_count(n_vectors, "n_vectors")
    n_steps = _check_count(n_steps, "n_steps")
    grid_points = _check_count(grid_points, "grid_points", 2)
    objective = _objective_for(model, data, layers, batch_size)
    n = objective.dimension
    steps = min(n_steps, n)
    rng = np.random.default_rng(seed)
    nodes = np.zeros((n_vectors, steps))
    weights = np.zeros((n_vectors, steps))
    product = _Progress(objective, n_vectors * steps, "Hessian density", verbose)
    for v in range(n_vectors):
        start = rng.choice([-1.0, 1.0], size=n)
        alpha, beta, _ = _lanczos.lanczos(product, start, steps)
        theta, u = _lanczos.ritz(alpha, beta)
        nodes[v, :theta.size] = theta
        weights[v, :theta.size] = u[0] ** 2
        nodes[v, theta.size:] = theta[-1]
    lo, hi = float(nodes.min()), float(nodes.max())
    if sigma is None:
        sigma = max(hi - lo, abs(hi), 1e-12) * 0.01
    grid = np.linspace(lo - 6 * sigma, hi + 6 * sigma, grid_points)
    kernel = np.exp(-0.5 * ((grid[:, None] - nodes.reshape(1, -1)) / sigma) ** 2)
    density = kernel @ weights.reshape(-1) / (n_vectors * sigma * np.sqrt(2 * np.pi))
    return Density(grid, density, nodes, weights, float(sigma))


def hessian_trace(model: keras.Model, data: Any, n_samples: int = 50, *,
                  layers: Sequence[str] | None = None, seed: int = 0,
                  batch_size: int = 256, verbose: int = 0) -> float:
    """Hutchinson's estimate of the trace of the loss's Hessian (Rademacher vectors)."""
    n_samples = _check_count(n_samples, "n_samples")
    objective = _objective_for(model, data, layers, batch_size)
    rng = np.random.default_rng(seed)
    product = _Progress(objective, n_samples, "Hessian trace", verbose)
    total = 0.0
    for _ in range(n_samples):
        v = rng.choice([-1.0, 1.0], size=objective.dimension)
        total += float(v @ product(v))
    return total / n_samples
