"""A Gaussian-process surrogate whose Cholesky factor grows by one row per observation.

Bayesian optimisation refits its GP after every result. Refactorising the
n x n covariance costs O(n^3); but the new covariance only borders the old one,
``K_{n+1} = [[K_n, p], [p^T, c]]``, so its factor is the old one plus a row:
``L_{n+1} = [[L_n, 0], [l^T, d]]`` with ``l = L_n^{-1} p`` and
``d = sqrt(c - l^T l)``, an O(n^2) triangular solve (``LazyGP.add``). The
kernel's hyperparameters stay fixed between refactorisations; the oracle calls
``fit_hyperparameters`` (maximum marginal likelihood, then a fresh factor)
every ``lag`` observations.

The factor is kept as the packed rows of L (LAPACK's packed upper storage of
L^T) in a buffer whose capacity doubles: a new row is appended at the end, and
the triangular solve (BLAS ``tpsv``) reads the buffer in place, so ``add``
copies nothing beyond the amortised growth. Targets are standardised with the
current data's mean and spread at every prediction; for that the factor's
solves against y and against a vector of ones are extended along with it.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np
import scipy.linalg
import scipy.optimize
from scipy.linalg import blas

log = logging.getLogger(__name__)

_SQRT5 = math.sqrt(5.0)
# bounds of the kernel hyperparameters (inputs in [0, 1]^d, standardised targets)
LENGTH_SCALE_BOUNDS = (1e-2, 2e1)
SIGNAL_VARIANCE_BOUNDS = (5e-2, 2e1)
NOISE_BOUNDS = (1e-6, 5e-1)
KERNELS = ("matern52", "rbf")


class LazyGP:
    """GP regression with ARD Matern 5/2 (or RBF) kernel, extended in O(n^2) per observation.

    ``dim`` inputs; ``bounds`` (``(low, high)`` arrays) maps inputs to [0, 1]^d,
    None means they are already there. Kernel hyperparameters: ``length_scales``
    (one per input, in normalised units), ``signal_variance`` and ``noise`` (in
    units of the standardised targets).
    """

    def __init__(self, dim: int, kernel: str = "matern52",
                 length_scales: float | Sequence[float] | np.ndarray | None = None,
                 signal_variance: float = 1.0, noise: float = 1e-4,
                 bounds: Sequence[tuple[float, float]] | np.ndarray | None = None,
                 capacity: int = 64, seed: int | None = None) -> None:
        if kernel not in KERNELS:
            raise ValueError("kernel must be one of %s, not %r" % (KERNELS, kernel))
        if dim < 1:
            raise ValueError("a GP needs at least one input dimension, got %d" % dim)
        self.dim = int(dim)
        self.kernel = kernel
        self.length_scales = (np.full(self.dim, 0.5) if length_scales is None
                              else np.asarray(length_scales, float).reshape(self.dim).copy())
        self.signal_variance = float(signal_variance)
        self.noise = float(noise)
        self.jitter = 0.0           # raised when an extension is numerically singular
        self.seed = seed
        if bounds is None:
            self._low, self._span = np.zeros(self.dim), np.ones(self.dim)
        else:
            low, high = (np.asarray(b, float).reshape(self.dim) for b in bounds)
            if np.any(high <= low):
                raise ValueError("every upper bound must exceed its lower bound")
            self._low, self._span = low, high - low
        self.n = 0
        self.stats = {"adds": 0, "refactorisations": 0, "refits": 0}
        self._allocate(max(int(capacity), 4))

    # ---- storage ---------------------------------------------------------------------------

    def _allocate(self, capacity, keep=0):
        """(Re)allocate the buffers for ``capacity`` observations, keeping the first ``keep``."""
        packed = np.empty(capacity * (capacity + 1) // 2)
        x, y = np.empty((capacity, self.dim)), np.empty(capacity)
        vy, v1 = np.empty(capacity), np.empty(capacity)
        if keep:
            packed[:keep * (keep + 1) // 2] = self._packed[:keep * (keep + 1) // 2]
            for new, old in ((x, self._x), (y, self._y), (vy, self._vy), (v1, self._v1)):
                new[:keep] = old[:keep]
        self._packed, self._x, self._y, self._vy, self._v1 = packed, x, y, vy, v1
        self.capacity = capacity
        self._dense = None

    @property
    def X(self) -> np.ndarray:
        """The observed inputs, normalised to [0, 1]^d (a copy)."""
        return self._x[:self.n].copy()

    @property
    def y(self) -> np.ndarray:
        """The observed targets, as given (a copy)."""
        return self._y[:self.n].copy()

    def normalise(self, X: np.ndarray | Sequence) -> np.ndarray:
        """Inputs in the caller's units -> [0, 1]^d."""
        return (np.asarray(X, float).reshape(-1, self.dim) - self._low) / self._span

    # ---- kernel ----------------------------------------------------------------------------

    def _k(self, A, B, length_scales=None, signal_variance=None):
        """Cross-covariance of normalised inputs (no noise)."""
        ls = self.length_scales if length_scales is None else length_scales
        sf2 = self.signal_variance if signal_variance is None else signal_variance
        a, b = A / ls, B / ls
        sq = (np.einsum("ij,ij->i", a, a)[:, None] + np.einsum("ij,ij->i", b, b)[None, :]
              - 2.0 * a @ b.T)
        np.maximum(sq, 0.0, out=sq)
        if self.kernel == "rbf":
            return sf2 * np.exp(-0.5 * sq)
        r = np.sqrt(sq)
        return sf2 * (1.0 + _SQRT5 * r + (5.0 / 3.0) * sq) * np.exp(-_SQRT5 * r)

    def _diagonal(self):
        return self.signal_variance + self.noise + self.jitter

    def covariance(self) -> np.ndarray:
        """K_n: the kernel matrix of the observations, noise and jitter on the diagonal."""
        x = self._x[:self.n]
        K = self._k(x, x)
        K[np.diag_indices_from(K)] += self.noise + self.jitter
        return K

    # ---- the factor ------------------------------------------------------------------------

    def _tri_solve(self, b):
        """L_n^{-1} b for one vector, from the packed factor in place (O(n^2), no copy)."""
        n = self.n
        return blas.dtpsv(n, self._packed[:n * (n + 1) // 2], np.array(b, float),
                          lower=0, trans=1, overwrite_x=1)

    def factor(self) -> np.ndarray:
        """L_n as a dense lower-triangular array (built from the packed rows, cached)."""
        if self._dense is None:
            n = self.n
            L = np.zeros((n, n))
            L[np.tril_indices(n)] = self._packed[:n * (n + 1) // 2]
            self._dense = L
        return self._dense

    def add(self, x: np.ndarray | Sequence[float], y: float) -> None:
        """Add one observation: extend the factor by a row in O(n^2), no refactorisation."""
        x = self.normalise(x)[0]
        y = float(y)
        if not math.isfinite(y):
            raise ValueError("a GP target must be finite, got %r" % y)
        n = self.n
        if n == self.capacity:
            self._allocate(2 * self.capacity, keep=n)
        c = self._diagonal()
        if n:
            p = self._k(self._x[:n], x[None, :])[:, 0]
            row = self._tri_solve(p)
            d2 = c - row @ row
        else:
            row, d2 = np.empty(0), c
        if d2 <= 1e-12 * c:
            # the new row is (numerically) a linear combination of the others: add jitter to
            # the diagonal and refactorise, rather than take the root of a rounding error
            self.jitter = max(10.0 * self.jitter, 1e-8 * self.signal_variance)
            log.info("LazyGP: singular extension at n=%d, jitter raised to %.3g", n, self.jitter)
            self._x[n], self._y[n] = x, y
            self.n = n + 1
            self.stats["adds"] += 1
            self.refactor()
            return
        d = math.sqrt(d2)
        start = n * (n + 1) // 2
        self._packed[start:start + n] = row
        self._packed[start + n] = d
        self._x[n], self._y[n] = x, y
        self._vy[n] = (y - row @ self._vy[:n]) / d
        self._v1[n] = (1.0 - row @ self._v1[:n]) / d
        self.n = n + 1
        self.stats["adds"] += 1
        self._dense = None

    def set_data(self, X: np.ndarray | Sequence, y: np.ndarray | Sequence[float]) -> None:
        """Replace the observations by ``X`` (caller's units), ``y`` and factorise afresh."""
        X = self.normalise(X)
        y = np.asarray(y, float).reshape(-1)
        if len(X) != len(y) or not np.all(np.isfinite(y)):
            raise ValueError("X and y need as many rows, and y finite values")
        capacity = self.capacity
        while capacity < len(y):
            capacity *= 2
        if capacity != self.capacity:
            self._allocate(capacity)
        self._x[:len(y)], self._y[:len(y)] = X, y
        self.n = len(y)
        self.refactor()

    def truncate(self, n: int) -> None:
        """Forget every observation after the first ``n`` (the factor's leading block stays)."""
        if not 0 <= n <= self.n:
            raise ValueError("cannot truncate %d observations to %d" % (self.n, n))
        if n != self.n:
            self.n = n
            self._dense = None

    def refactor(self) -> None:
        """A fresh Cholesky factorisation of K_n with the same kernel hyperparameters."""
        n = self.n
        self._dense = None
        if n == 0:
            return
        while True:
            try:
                L = scipy.linalg.cholesky(self.covariance(), lower=True, check_finite=False)
                break
            except np.linalg.LinAlgError:
                self.jitter = max(10.0 * self.jitter, 1e-8 * self.signal_variance)
                log.info("LazyGP: K not positive definite at n=%d, jitter %.3g", n, self.jitter)
        self._packed[:n * (n + 1) // 2] = L[np.tril_indices(n)]
        y = self._y[:n]
        self._vy[:n] = scipy.linalg.solve_triangular(L, y, lower=True, check_finite=False)
        self._v1[:n] = scipy.linalg.solve_triangular(L, np.ones(n), lower=True,
                                                     check_finite=False)
        self._dense = L
        self.stats["refactorisations"] += 1

    # ---- predictions -----------------------------------------------------------------------

    def _standardisation(self):
        """(mean, scale) of the current targets."""
        y = self._y[:self.n]
        if self.n == 0:
            return 0.0, 1.0
        mean = float(y.mean())
        scale = float(y.std())
        return mean, scale if scale > 1e-12 * max(1.0, abs(mean)) else 1.0

    def _weights(self):
        """L^{-1} (y - mean) / scale: the standardised targets, whitened."""
        mean, scale = self._standardisation()
        n = self.n
        return (self._vy[:n] - mean * self._v1[:n]) / scale, mean, scale

    def predict(self, X: np.ndarray | Sequence,
                return_std: bool = True) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Posterior mean (and standard deviation) of the latent function at ``X``.

        ``X`` is in the caller's units (``bounds``); returns arrays of shape (m,).
        """
        Xn = self.normalise(X)
        mean, scale = self._standardisation()
        if self.n == 0:
            mu = np.full(len(Xn), mean)
            std = np.full(len(Xn), scale * math.sqrt(self.signal_variance))
            return (mu, std) if return_std else mu
        v, mean, scale = self._weights()
        Ks = self._k(self._x[:self.n], Xn)
        if len(Xn) == 1:
            W = self._tri_solve(Ks[:, 0])[:, None]
        else:
            W = scipy.linalg.solve_triangular(self.factor(), Ks, lower=True,
                                              check_finite=False)
        mu = mean + scale * (W.T @ v)
        if not return_std:
            return mu
        var = self.signal_variance - np.einsum("ij,ij->j", W, W)
        return mu, scale * np.sqrt(np.maximum(var, 0.0))

    def log_marginal_likelihood(self) -> float:
        """log p(y | X, kernel hyperparameters) of the standardised targets, from the factor."""
        n = self.n
        if n == 0:
            return 0.0
        v, _, _ = self._weights()
        diag = self._packed[(np.arange(n) + 1) * (np.arange(n) + 2) // 2 - 1]
        return float(-0.5 * v @ v - np.log(diag).sum() - 0.5 * n * math.log(2 * math.pi))

    # ---- hyperparameters -------------------------------------------------------------------

    def get_hyperparameters(self) -> dict:
        return {"length_scales": self.length_scales.tolist(),
                "signal_variance": self.signal_variance, "noise": self.noise,
                "jitter": self.jitter}

    def set_hyperparameters(self, length_scales: float | Sequence[float] | np.ndarray | None = None,
                            signal_variance: float | None = None, noise: float | None = None,
                            jitter: float | None = None) -> None:
        """Set kernel hyperparameters and refactorise (the old factor is for the old kernel)."""
        if length_scales is not None:
            self.length_scales = np.asarray(length_scales, float).reshape(self.dim).copy()
        if signal_variance is not None:
            self.signal_variance = float(signal_variance)
        if noise is not None:
            self.noise = float(noise)
        if jitter is not None:
            self.jitter = float(jitter)
        self.refactor()

    def _negative_lml(self, theta, raw2, ys):
        """-log marginal likelihood and its gradient in log-hyperparameters ``theta``.

        ``raw2[i, j, k]`` = (x_ik - x_jk)^2, computed once per fit.
        """
        d = self.dim
        ls, sf2, noise = np.exp(theta[:d]), math.exp(theta[d]), math.exp(theta[d + 1])
        n = len(ys)
        diff2 = raw2 / ls ** 2                                        # (n, n, d)
        sq = diff2.sum(-1)
        if self.kernel == "rbf":
            Ks = sf2 * np.exp(-0.5 * sq)
            dls = Ks[:, :, None] * diff2
        else:
            r = np.sqrt(sq)
            e = np.exp(-_SQRT5 * r)
            Ks = sf2 * (1.0 + _SQRT5 * r + (5.0 / 3.0) * sq) * e
            dls = (sf2 * (5.0 / 3.0) * (1.0 + _SQRT5 * r) * e)[:, :, None] * diff2
        K = Ks + (noise + self.jitter) * np.eye(n)
        try:
            L = scipy.linalg.cholesky(K, lower=True, check_finite=False)
        except np.linalg.LinAlgError:
            return 1e25, np.zeros_like(theta)
        alpha = scipy.linalg.cho_solve((L, True), ys, check_finite=False)
        value = 0.5 * ys @ alpha + np.log(np.diag(L)).sum() + 0.5 * n * math.log(2 * math.pi)
        inner = np.outer(alpha, alpha) - scipy.linalg.cho_solve((L, True), np.eye(n),
                                                                check_finite=False)
        grad = np.empty_like(theta)
        grad[:d] = -0.5 * np.einsum("ij,ijk->k", inner, dls)
        grad[d] = -0.5 * np.sum(inner * Ks)
        grad[d + 1] = -0.5 * noise * np.trace(inner)
        return value, grad

    def fit_hyperparameters(self, restarts: int = 2, seed: int | None = None, maxiter: int = 100,
                            isotropic: bool = False) -> float:
        """Maximise the log marginal likelihood over the kernel hyperparameters, then refactor.

        Starts from the current values and ``restarts`` random points (bounded
        L-BFGS-B in log space); keeps the current values unless a start improves
        on them. ``isotropic``: one length scale shared by every input (fewer
        hyperparameters for a small GP to pin down; the current start is the
        geometric mean of the current length scales). Returns the new log
        marginal likelihood.
        """
        n = self.n
        if n < 2:
            self.refactor()
            return self.log_marginal_likelihood()
        mean, scale = self._standardisation()
        x, ys = self._x[:n], (self._y[:n] - mean) / scale
        raw2 = (x[:, None, :] - x[None, :, :]) ** 2
        d = self.dim
        scales = 1 if isotropic else d
        bounds = ([tuple(np.log(LENGTH_SCALE_BOUNDS))] * scales
                  + [tuple(np.log(SIGNAL_VARIANCE_BOUNDS)), tuple(np.log(NOISE_BOUNDS))])
        low, high = np.array(bounds).T
        log_scales = np.log(self.length_scales)
        current = np.clip(np.concatenate([[log_scales.mean()] if isotropic else log_scales,
                                          [math.log(self.signal_variance),
                                           math.log(self.noise)]]), low, high)

        def full(theta):
            """Free parameters -> (log length scales (d), log signal variance, log noise)."""
            return np.concatenate([np.repeat(theta[:1], d), theta[1:]]) if isotropic else theta

        def objective(theta):
            value, grad = self._negative_lml(full(theta), raw2, ys)
            if isotropic:
                grad = np.concatenate([[grad[:d].sum()], grad[d:]])
            return value, grad

        rng = np.random.default_rng(self.seed if seed is None else seed)
        starts = [current] + [rng.uniform(low, high) for _ in range(restarts)]
        best_theta, best_value = current, objective(current)[0]
        for start in starts:
            try:
                result = scipy.optimize.minimize(objective, start, jac=True, method="L-BFGS-B",
                                                 bounds=bounds, options={"maxiter": maxiter})
            except (ValueError, FloatingPointError, np.linalg.LinAlgError) as exc:
                log.debug("LazyGP: a hyperparameter restart failed: %s", exc)
                continue
            if np.isfinite(result.fun) and result.fun < best_value:
                best_theta, best_value = np.clip(result.x, low, high), float(result.fun)
        best_theta = full(best_theta)
        self.length_scales = np.exp(best_theta[:d])
        self.signal_variance = float(math.exp(best_theta[d]))
        self.noise = float(math.exp(best_theta[d + 1]))
        self.stats["refits"] += 1
        self.refactor()
        return self.log_marginal_likelihood()
