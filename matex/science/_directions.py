"""Directions in weight space for loss surfaces: random (filter-normalised) or PCA.

Filter normalisation (Li et al., "Visualizing the Loss Landscape of Neural
Nets", 2018): a Gaussian direction is rescaled filter by filter so that each
filter of the direction has the norm of the same filter of the weights,
which makes surfaces of differently scaled networks comparable. Keras keeps
the output unit on the LAST axis (Dense ``(in, out)``, Conv ``(kh, kw, in,
out)``), so a filter/neuron is a slice ``[..., j]``. One-dimensional
weights (biases, BatchNormalization's scale and offset) get a zero
direction (``ignore="biasbn"``, what Li et al. use in their figures) or,
with ``ignore=None``, a copy of the weights (what their code does then).

PCA directions (Li et al., section 7): the two leading right singular
vectors of the matrix whose rows are the recorded weights minus the final
weights; the trajectory's coordinates are its projection on them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

NORMALIZATIONS = ("filter", None)
IGNORES = ("biasbn", None)


def check_shapes(direction, weights, name: str = "direction") -> list:
    """``direction`` as float64 arrays, after checking it matches ``weights`` array by array."""
    if not isinstance(direction, (list, tuple)):
        raise ValueError("matex.science: %s must be a list of arrays shaped like "
                         "model.trainable_weights, not %s" % (name, type(direction).__name__))
    if len(direction) != len(weights):
        raise ValueError("matex.science: %s has %d arrays, the model %d trainable weights"
                         % (name, len(direction), len(weights)))
    out = []
    for i, (d, w) in enumerate(zip(direction, weights)):
        d = np.asarray(d, np.float64)
        if d.shape != tuple(w.shape):
            raise ValueError("matex.science: %s[%d] has shape %s, the weight %s"
                             % (name, i, d.shape, tuple(w.shape)))
        out.append(d)
    return out


def filter_normalize(direction: Sequence[np.ndarray], weights: Sequence[np.ndarray],
                     ignore: str | None = "biasbn") -> list:
    """``direction`` rescaled filter by filter to the norms of ``weights`` (see module doc)."""
    if ignore not in IGNORES:
        raise ValueError("ignore must be 'biasbn' or None, not %r" % (ignore,))
    out = []
    for d, w in zip(direction, weights):
        d = np.array(d, np.float64)
        w = np.asarray(w, np.float64)
        if d.ndim <= 1:
            out.append(np.zeros_like(d) if ignore == "biasbn" else w.copy())
            continue
        axes = tuple(range(d.ndim - 1))
        d_norm = np.sqrt(np.sum(d * d, axis=axes, keepdims=True))
        w_norm = np.sqrt(np.sum(w * w, axis=axes, keepdims=True))
        out.append(d * w_norm / (d_norm + 1e-10))
    return out


def random_directions(weights, seed: int = 0, normalization="filter", ignore="biasbn"):
    """Two Gaussian directions drawn from ``seed`` (the same on every rank), normalised."""
    if normalization not in NORMALIZATIONS:
        raise ValueError("normalization must be 'filter' or None, not %r" % (normalization,))
    rng = np.random.default_rng(seed)
    pair = []
    for _ in range(2):
        d = [rng.standard_normal(np.shape(w)) for w in weights]
        pair.append(filter_normalize(d, weights, ignore) if normalization == "filter" else d)
    return tuple(pair)


def pca_directions(trajectory: np.ndarray, final: np.ndarray | None = None):
    """``(d1, d2, coords, explained)`` from a ``(steps, parameters)`` trajectory.

    ``d1``, ``d2``: flat unit vectors; ``coords``: ``(steps, 2)`` positions of
    the recorded weights relative to ``final`` (default: the last row);
    ``explained``: the fraction of the variance each direction carries.
    """
    trajectory = np.asarray(trajectory, np.float64)
    if trajectory.ndim != 2 or trajectory.shape[0] < 3:
        raise ValueError("matex.science: PCA directions need a trajectory of at least 3 "
                         "recorded weight vectors (got shape %s)" % (trajectory.shape,))
    final = trajectory[-1] if final is None else np.asarray(final, np.float64)
    diffs = trajectory - final
    _, s, vt = np.linalg.svd(diffs, full_matrices=False)
    d1, d2 = vt[0], vt[1]
    explained = (s[:2] ** 2) / max(float(np.sum(s ** 2)), 1e-300)
    coords = diffs @ np.stack([d1, d2], 1)
    return d1, d2, coords, explained


def project(trajectory: np.ndarray, vectors, origin: np.ndarray) -> np.ndarray:
    """Coordinates of each row of ``trajectory - origin`` in the span of ``vectors`` (flat).

    Least squares, so directions need not be orthogonal (random ones are not).
    """
    basis = np.stack([np.asarray(v, np.float64).reshape(-1) for v in vectors], 1)
    diffs = np.asarray(trajectory, np.float64) - np.asarray(origin, np.float64).reshape(-1)
    coords, *_ = np.linalg.lstsq(basis, diffs.T, rcond=None)
    return coords.T
