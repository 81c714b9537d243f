"""A model's compiled loss over all the data, as a function of its weights: value and H·v.

The loss is ``model.evaluate``'s (see ``_data``): every rank of the
communicator in slot ``comm`` sums ``batch_loss * rows`` over its share, one
allreduce adds the ranks' sums, the global row count divides. A
Hessian-vector product is the same sum differentiated twice (double
backprop, nested ``tf.GradientTape``), each rank's products fused into one
flat vector and added with ONE allreduce.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from matex import _collectives, _runtime


def check_model(model) -> None:
    """Raise ``ValueError`` unless ``model`` is compiled with a loss and has trainable weights.

    Deterministic in the model alone, so every rank raises the same error.
    """
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError("matex.science: expected a keras.Model, not %s" % type(model).__name__)
    overridden = type(model).compute_loss is not keras.Model.compute_loss
    if not getattr(model, "compiled", False) or (getattr(model, "loss", None) is None
                                                 and not overridden):
        raise ValueError("matex.science: the model is not compiled with a loss; call "
                         "model.compile(loss=...) first (the surface and the Hessian are "
                         "those of the compiled loss)")
    if not model.trainable_weights:
        raise ValueError("matex.science: the model has no trainable weights (build it on "
                         "data or an input shape first, and leave some layers trainable)")


def select_variables(model, layers=None) -> list:
    """The trainable variables of ``model``, or of the layers named in ``layers`` only."""
    if layers is None:
        return list(model.trainable_weights)
    if isinstance(layers, str):
        layers = [layers]
    names = [layer.name for layer in model.layers]
    variables = []
    for name in layers:
        if name not in names:
            raise ValueError("matex.science: the model has no layer %r (its layers: %s)"
                             % (name, ", ".join(names)))
        variables += list(model.get_layer(name).trainable_weights)
    if not variables:
        raise ValueError("matex.science: the layers %s have no trainable weights" % list(layers))
    return variables


class Objective:
    """``model``'s compiled loss over ``share`` (``_data.Share``), reduced over slot ``comm``."""

    def __init__(self, model, share, comm: int = 0, variables=None):
        check_model(model)
        self.model, self.share, self.comm = model, share, comm
        self.variables = list(variables if variables is not None else model.trainable_weights)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dtype = self.variables[0].dtype
        self._rows = None
        self._batch_sum = tf.function(self._batch_sum_eager, reduce_retracing=True)
        self._batch_hvp = tf.function(self._batch_hvp_eager, reduce_retracing=True)

    # ---- one batch ---------------------------------------------------------------

    def _batch_sum_eager(self, x, y, sw):
        y_pred = self.model(x, training=False)
        loss = self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw,
                                       training=False)
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        return tf.cast(loss, tf.float64) * tf.cast(rows, tf.float64), rows

    def _batch_hvp_eager(self, x, y, sw, vector):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                total, _ = self._batch_sum_eager(x, y, sw)
            grads = inner.gradient(total, self.variables,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
            dot = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float64) * tf.cast(v, tf.float64))
                            for g, v in zip(grads, vector)])
        products = outer.gradient(dot, self.variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return tf.concat([tf.reshape(tf.cast(p, tf.float64), [-1]) for p in products], 0)

    # ---- over all the data -------------------------------------------------------

    def _reduce(self, values: np.ndarray) -> np.ndarray:
        if _runtime.slot_comm(self.comm).Get_size() == 1:
            return values
        return _collectives.allreduce(tf.constant(values), "sum", comm=self.comm).numpy()

    def loss(self) -> float:
        """The loss at the model's current weights, over all the data (collective)."""
        total, rows = 0.0, 0
        for x, y, sw in self.share.batches():
            s, r = self._batch_sum(x, y, sw)
            total += float(s)
            rows += int(r)
        total, rows = self._reduce(np.array([total, rows], np.float64))
        self._rows = int(rows)
        if rows == 0:
            raise ValueError("matex.science: the data has no rows")
        return float(total / rows)

    def rows(self) -> int:
        """Rows in all the data (collective the first time, for a dataset)."""
        if self._rows is None:
            if self.share.local_rows is not None:
                self._rows = self.share.global_rows
            else:
                local = sum(int(tf.shape(tf.nest.flatten(x)[0])[0])
                            for x, _, _ in self.share.batches())
                self._rows = int(self._reduce(np.array([local], np.float64))[0])
            if self._rows == 0:
                raise ValueError("matex.science: the data has no rows")
        return self._rows

    @property
    def dimension(self) -> int:
        return int(sum(self.sizes))

    def hvp(self, vector: np.ndarray) -> np.ndarray:
        """H·``vector`` (flat, float64) for the Hessian of the loss over all the data."""
        rows = self.rows()
        parts = [tf.constant(p.reshape(s), self.dtype)
                 for p, s in zip(np.split(vector, np.cumsum(self.sizes)[:-1]), self.shapes)]
        local = np.zeros(self.dimension, np.float64)
        for x, y, sw in self.share.batches():
            local += self._batch_hvp(x, y, sw, parts).numpy()
        return self._reduce(local) / rows

    # ---- weights ------------------------------------------------------------------

    def get(self) -> list:
        return [v.numpy() for v in self.variables]

    def set(self, values) -> None:
        for v, value in zip(self.variables, values):
            v.assign(np.asarray(value, dtype=v.dtype))

    def flatten(self, arrays) -> np.ndarray:
        return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays])

    def unflatten(self, flat: np.ndarray) -> list:
        return [p.reshape(s) for p, s in zip(np.split(np.asarray(flat),
                                                      np.cumsum(self.sizes)[:-1]), self.shapes)]
