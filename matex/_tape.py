"""DistributedGradientTape: a GradientTape whose gradients are averaged over ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from matex import _state
from matex.compression import _spec as _compression
from matex.compression import _reduce

if TYPE_CHECKING:
    from matex.compression import Compressor

# (mixin, tape class) -> their subclass
_classes: dict = _state.table("tape.classes", lifetime="process")


def mix_in(tape: tf.GradientTape, mixin: type) -> tf.GradientTape:
    """``tape``, converted in place to a subclass with ``mixin`` first (made once per class).

    Converting keeps the recording the user's ``with`` block made, whatever tape
    subclass it is; a tape converted already is left as it is.
    """
    if not isinstance(tape, tf.GradientTape):
        raise TypeError("DistributedGradientTape needs a tf.GradientTape, got %r" % (tape,))
    cls = type(tape)
    if not issubclass(cls, mixin):
        if (mixin, cls) not in _classes:
            _classes[mixin, cls] = type(cls.__name__, (mixin, cls), {})
        tape.__class__ = _classes[mixin, cls]
    return tape


class _DistributedTapeMixin:
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        op, threshold, compressor = self._matex_settings
        if _reduce.nothing_to_reduce(compressor):
            return grads
        if op == "adasum":   # dense: Adasum combines whole vectors
            flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                    for g in flat]
        variables = tf.nest.flatten(sources, expand_composites=False)
        reduced = _reduce.reduce_gradients(
            flat, variables if len(variables) == len(flat) else None, compressor, op, threshold)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(tape: tf.GradientTape, op: str = "average",
                            fusion_threshold: int | None = None,
                            compression: Compressor | str | None = None) -> tf.GradientTape:
    """Make ``tape.gradient`` return gradients reduced over all ranks.

    Args:
      tape: a ``tf.GradientTape`` (converted in place and returned).
      op: "average" (default), "sum" or "adasum" (``matex.allreduce``; sparse
        gradients are made dense; no compression).
      fusion_threshold: bucket size in bytes for fusing small gradients
        (default ``MATEX_FUSION_THRESHOLD`` or 16 MiB; 0 disables fusion).
      compression: a ``matex.compression`` compressor or its text, as for
        ``DistributedOptimizer`` (default ``MATEX_COMPRESSION``). Keep the
        compressor object across steps (it holds the error-feedback residuals).

    Example:
      >>> with tf.GradientTape() as tape:
      ...     loss = loss_fn(y, model(x, training=True))
      >>> tape = matex.DistributedGradientTape(tape)
      >>> grads = tape.gradient(loss, model.trainable_variables)

    Use it or ``DistributedOptimizer``, not both: each reduces the gradients.
    """
    if op not in ("average", "sum", "adasum"):
        raise ValueError("DistributedGradientTape op must be 'average', 'sum' or 'adasum', "
                         "not %r" % op)
    mix_in(tape, _DistributedTapeMixin)
    compressor = (_compression.from_environment() if compression is None
                  else _compression.from_spec(compression))
    if op == "adasum" and compressor is not None:
        raise ValueError("DistributedGradientTape: op='adasum' sends its gradients "
                         "uncompressed; compression %r (or MATEX_COMPRESSION) is not used "
                         "with it" % (compressor,))
    tape._matex_settings = (op, fusion_threshold, compressor)
    return tape
