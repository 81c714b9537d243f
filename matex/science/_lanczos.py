"""Lanczos with full reorthogonalisation on a symmetric operator given by its products.

Plain NumPy on vectors every rank holds whole (the operator's products are
the collective part): the same start vector and the same products give the
same basis on every rank, so nothing here communicates.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import eigh_tridiagonal


def lanczos(matvec, start: np.ndarray, steps: int, restart_rng=None, tol: float = 1e-10):
    """``(alpha, beta, basis)`` of ``steps`` Lanczos steps from ``start``.

    ``alpha`` (m,) and ``beta`` (m-1,) are the tridiagonal matrix T, ``basis``
    the (m, n) orthonormal Lanczos vectors, ``H ~ basis.T @ T @ basis``. Every
    new vector is orthogonalised (twice) against all earlier ones. When the
    Krylov space is exhausted (an invariant subspace: ``beta`` ~ 0) the run
    stops, or, with ``restart_rng``, goes on from a fresh random vector
    orthogonal to the basis (``beta`` = 0 there), so repeated eigenvalues are
    found with their multiplicity.
    """
    n = start.size
    steps = max(1, min(int(steps), n))
    basis = np.zeros((steps, n))
    alpha = np.zeros(steps)
    beta = np.zeros(steps)   # beta[j] couples vectors j-1 and j
    q = start / np.linalg.norm(start)
    scale = 0.0
    m = steps
    for j in range(steps):
        basis[j] = q
        w = matvec(q)
        alpha[j] = q @ w
        w = w - alpha[j] * q - (beta[j] * basis[j - 1] if j else 0.0)
        for _ in range(2):
            w -= basis[:j + 1].T @ (basis[:j + 1] @ w)
        if j + 1 == steps:
            break
        b = np.linalg.norm(w)
        scale = max(scale, abs(alpha[j]), b)
        if b > tol * max(scale, 1e-300):
            beta[j + 1] = b
            q = w / b
            continue
        if restart_rng is None:
            m = j + 1
            break
        for _ in range(3):   # a fresh direction outside the space found so far
            w = restart_rng.standard_normal(n)
            for _ in range(2):
                w -= basis[:j + 1].T @ (basis[:j + 1] @ w)
            if np.linalg.norm(w) > 1e-8:
                break
        beta[j + 1] = 0.0
        q = w / np.linalg.norm(w)
    return alpha[:m], beta[1:m], basis[:m]


def ritz(alpha: np.ndarray, beta: np.ndarray):
    """Eigenvalues (ascending) and eigenvectors of the tridiagonal ``(alpha, beta)``."""
    if alpha.size == 1:
        return alpha.copy(), np.ones((1, 1))
    return eigh_tridiagonal(alpha, beta)
