"""Top-k sparsification: each rank sends its k largest-magnitude entries, exchanged with
the sparse allreduce (the union of the ranks' entries, summed)."""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from matex import _collectives, _sparse
from matex.compression._base import (DEFAULT_MIN_SIZE, Compressor, ErrorFeedback, Item,
                                     check_float, check_ratio)


class TopK(Compressor):
    """Send the ``ratio`` fraction of largest-magnitude entries of each gradient.

    With ``error_feedback`` (default) the entries not sent stay in a per-rank
    residual added to the next step's gradient. All compressed gradients of
    one dtype share one sparse allreduce (indices offset into one flat
    space); the result is the sum over ranks of their entries (divided by the
    ranks for "average"), identical on every rank.
    """

    name = "TopK"

    def __init__(self, ratio: float, error_feedback: bool = True, min_size: int | None = None,
                 density_threshold: float | None = None) -> None:
        super().__init__(DEFAULT_MIN_SIZE if min_size is None else min_size)
        self.ratio = check_ratio(ratio, "TopK")
        self.error_feedback = bool(error_feedback)
        self.density_threshold = density_threshold
        self.memory = ErrorFeedback()

    def k(self, size: int) -> int:
        return max(1, int(math.ceil(self.ratio * size)))

    def reduce(self, items: Sequence[Item], op: str,
               threshold: int) -> tuple[list[tf.Tensor], list[int]]:
        out, sent = [None] * len(items), [None] * len(items)
        by_dtype = {}
        for i, it in enumerate(items):
            check_float(it, self.name)
            by_dtype.setdefault(it.grad.dtype, []).append(i)
        for group in by_dtype.values():
            self._reduce_group([items[i] for i in group], op, out, sent, group)
        return out, sent

    def _reduce_group(self, items, op, out, sent, where):
        flats, idxs, vals, offsets, ks = [], [], [], [], []
        offset = 0
        for it in items:
            flat = tf.reshape(it.grad, [-1])
            if self.error_feedback:
                flat = flat + tf.reshape(self.memory.residual(it), [-1])
            k = self.k(it.size)
            chosen = tf.math.top_k(tf.abs(flat), k, sorted=False).indices
            flats.append(flat)
            idxs.append(chosen)
            vals.append(tf.gather(flat, chosen))
            offsets.append(offset)
            ks.append(k)
            offset += it.size
        indices = tf.concat([tf.cast(i, tf.int64) + o for i, o in zip(idxs, offsets)], 0)
        out_idx, out_vals, _, nbytes = _sparse.exchange(
            indices, tf.concat(vals, 0), offset, self.density_threshold)
        if op == "average":
            out_vals = out_vals / tf.cast(_collectives.comm_info()[1], out_vals.dtype)
        total = tf.scatter_nd(out_idx[:, None], out_vals, [offset])
        for j, it in enumerate(items):
            out[where[j]] = tf.reshape(total[offsets[j]:offsets[j] + it.size], it.grad.shape)
            # the fused stream's bytes, shared out by each gradient's part of it
            sent[where[j]] = nbytes * ks[j] // sum(ks)
            if self.error_feedback:
                kept = tf.tensor_scatter_nd_update(
                    flats[j], idxs[j][:, None], tf.zeros([ks[j]], flats[j].dtype))
                self.memory.residual(it).assign(tf.reshape(kept, it.grad.shape))

    def __repr__(self):
        return "TopK(%g, error_feedback=%s)" % (self.ratio, self.error_feedback)
