"""The loss along the straight line between two sets of weights (Goodfellow et al. 2015).

Data-parallel over all ranks (each point's loss is one allreduce); the
points are few, so they are not handed out to rank groups as a surface's are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from matex import _runtime
from matex.science import _data, _directions, _objective

if TYPE_CHECKING:
    import keras


def _weights_of(value, reference, name):
    import keras

    if isinstance(value, keras.Model):
        return [v.numpy() for v in value.trainable_weights]
    return _directions.check_shapes(list(value), reference, name)


def interpolate(a: keras.Model | Sequence[np.ndarray], b: keras.Model | Sequence[np.ndarray],
                data: Any, points: int = 25, *, model: keras.Model | None = None,
                alphas: Sequence[float] | np.ndarray | None = None,
                batch_size: int = 256) -> tuple:
    """Losses at ``(1 - alpha) * a + alpha * b`` for alpha in ``alphas`` (collective).

    Args:
      a, b: two Keras models of the same architecture, or lists of arrays
        shaped like ``model.trainable_weights``.
      data: global ``(x, y[, sample_weight])`` arrays or a ``tf.data.Dataset``.
      points: how many alphas, evenly from 0 to 1 (ignored when ``alphas`` is given;
        values outside [0, 1] extrapolate).
      model: the compiled model to evaluate with (default: ``a`` when it is a model).
    Returns:
      ``(alphas, losses)``, float64 arrays. The model's weights are put back.
    """
    import keras

    if model is None:
        if not isinstance(a, keras.Model):
            raise ValueError("matex.science.interpolate: pass model= when a and b are weights")
        model = a
    _objective.check_model(model)
    if alphas is None:
        if isinstance(points, bool) or not isinstance(points, int) or points < 2:
            raise ValueError("points must be a whole number >= 2, not %r" % (points,))
        alphas = np.linspace(0.0, 1.0, points)
    alphas = np.asarray(alphas, np.float64).reshape(-1)
    reference = model.trainable_weights
    wa, wb = _weights_of(a, reference, "a"), _weights_of(b, reference, "b")
    share = _data.Share(data, _runtime.rank(), _runtime.size(), batch_size, whole_job=True)
    objective = _objective.Objective(model, share)
    saved = objective.get()
    losses = np.empty(alphas.size)
    try:
        for i, alpha in enumerate(alphas):
            objective.set([(1 - alpha) * np.asarray(p, np.float64) + alpha * np.asarray(
                q, np.float64) for p, q in zip(wa, wb)])
            losses[i] = objective.loss()
    finally:
        objective.set(saved)
    return alphas, losses
