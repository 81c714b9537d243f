"""Random-k sparsification: every rank picks the same k positions from a seed shared
by all ranks and advancing per step, so only the k values travel (a dense allreduce)."""

import math

import tensorflow as tf

from matex import _fusion
from matex.compression._base import Compressor, ErrorFeedback, check_float, check_ratio


class RandomK(Compressor):
    """Send a random ``ratio`` fraction of each gradient's entries, the same on every rank.

    The positions come from ``tf.random.stateless_uniform`` seeded by
    (``seed`` + the gradient's position, step): no index is sent, and the k
    values of all compressed gradients go through the fused dense allreduce.
    With ``error_feedback`` (default) the entries not sent stay in a per-rank
    residual. Not rescaled by n/k (error feedback makes up the rest).
    """

    name = "RandomK"

    def __init__(self, ratio, error_feedback=True, seed=1234, min_size=None):
        from matex.compression._base import DEFAULT_MIN_SIZE

        super().__init__(DEFAULT_MIN_SIZE if min_size is None else min_size)
        self.ratio = check_ratio(ratio, "RandomK")
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.memory = ErrorFeedback()

    def reduce(self, items, op, threshold):
        step = self.step()
        flats, idxs, vals = [], [], []
        for i, it in enumerate(items):
            check_float(it, self.name)
            flat = tf.reshape(it.grad, [-1])
            if self.error_feedback:
                flat = flat + tf.reshape(self.memory.residual(it), [-1])
            k = max(1, int(math.ceil(self.ratio * it.size)))
            seed = tf.stack([tf.constant(self.seed + i, tf.int64), step])
            chosen = tf.math.top_k(tf.random.stateless_uniform([it.size], seed), k,
                                   sorted=False).indices
            flats.append(flat)
            idxs.append(chosen)
            vals.append(tf.gather(flat, chosen))
        reduced = _fusion.allreduce_gradients(vals, op, threshold, [it.name for it in items])
        out, sent = [], []
        for it, flat, chosen, r, v in zip(items, flats, idxs, reduced, vals):
            out.append(tf.reshape(tf.scatter_nd(chosen[:, None], r, [it.size]), it.grad.shape))
            sent.append(v.shape.num_elements() * v.dtype.size)
            if self.error_feedback:
                kept = tf.tensor_scatter_nd_update(flat, chosen[:, None], tf.zeros_like(v))
                self.memory.residual(it).assign(tf.reshape(kept, it.grad.shape))
        return out, sent

    def __repr__(self):
        return "RandomK(%g, error_feedback=%s)" % (self.ratio, self.error_feedback)
