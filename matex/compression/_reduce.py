"""Reduce one step's gradients: sparse ones sparsely, the compressor's through it, the rest
dense and fused; count the bytes (``matex._stats``).

This is the single path ``DistributedOptimizer`` and ``DistributedGradientTape`` take.
"""

import tensorflow as tf

from matex import _collectives, _fusion, _runtime, _sparse, _stats
from matex.compression._base import Item


def _name(names, variables, i):
    if names and i < len(names) and names[i]:
        return names[i]
    if variables and i < len(variables) and variables[i] is not None:
        v = variables[i]
        name = getattr(v, "path", None) or getattr(v, "name", None)
        if name:
            return name
    return "gradient_%d" % i


def _dense_bytes(shape, dtype):
    n = shape.num_elements()
    return None if n is None else n * dtype.size


def nothing_to_reduce(compressor=None) -> bool:
    """Whether the gradients reduced over the ranks are the gradients themselves: one rank
    (the sum and the average of one contribution, and its share of the rows is all of
    them) and no compressor (which changes them even there). The step is then built as
    plain Keras's, with no collective and no weighting. Decided when the step is traced;
    the communicator never grows while a job runs."""
    return compressor is None and _runtime.size() == 1


def reduce_gradients(grads, variables=None, compressor=None, op="average", threshold=None,
                     names=None, weight=None):
    """The gradients reduced over ranks (``None`` stays ``None``), in order.

    ``weight``: a scalar each gradient is multiplied by first (the rows-weighted
    average passes it with op "sum"). ``tf.IndexedSlices`` go through the
    sparse allreduce and come back as IndexedSlices (dense, eagerly, when the
    result went dense).
    """
    out = list(grads)
    variables = list(variables) if variables is not None else None
    dense_items, dense_at, comp_items, comp_at = [], [], [], []
    record_names, sent, dense = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        name = _name(names, variables, i)
        if isinstance(g, tf.IndexedSlices):
            values = g.values if weight is None else g.values * tf.cast(weight, g.values.dtype)
            shape = g.dense_shape if g.dense_shape is not None else tf.shape(
                variables[i] if variables else values, out_type=tf.int64)
            out[i], nbytes = _sparse.reduce_slices(values, g.indices, shape, op)
            record_names.append(name)
            sent.append(nbytes)
            static = tf.get_static_value(shape)
            dense.append(int(static.prod()) * values.dtype.size if static is not None else
                         tf.reduce_prod(tf.cast(shape, tf.int64)) * values.dtype.size)
            continue
        t = _collectives._as_tensor(g, "allreduce")
        if weight is not None:
            t = t * tf.cast(weight, t.dtype)
        item = Item(t, variables[i] if variables and i < len(variables) else None, name)
        if compressor is not None and compressor.selects(item):
            comp_items.append(item)
            comp_at.append(i)
        else:
            dense_items.append(item)
            dense_at.append(i)
    if dense_items:
        reduced = _fusion.allreduce_gradients([it.grad for it in dense_items], op, threshold,
                                              [it.name for it in dense_items])
        for i, it, r in zip(dense_at, dense_items, reduced):
            out[i] = r
            nbytes = _dense_bytes(it.grad.shape, it.grad.dtype)
            if nbytes is None:
                nbytes = tf.size(it.grad, out_type=tf.int64) * it.grad.dtype.size
            record_names.append(it.name)
            sent.append(nbytes)
            dense.append(nbytes)
    if comp_items:
        reduced, comp_sent = compressor.reduce(comp_items, op, threshold)
        for i, it, r, s in zip(comp_at, comp_items, reduced, comp_sent):
            out[i] = r
            record_names.append(it.name)
            sent.append(s)
            dense.append(_dense_bytes(it.grad.shape, it.grad.dtype))
    _stats.record(record_names, sent, dense)
    return out
