"""PowerSGD (Vogels et al., 2019): a rank-r approximation P Q^T of each gradient matrix,
found by one power-iteration step per training step; only P and Q travel."""

from __future__ import annotations

import logging
from typing import Sequence

import tensorflow as tf

from matex import _fusion
from matex.compression._base import (DEFAULT_MIN_SIZE, Compressor, ErrorFeedback, Item,
                                     PerVariable,
                                     check_float)

log = logging.getLogger("matex.compression")


def as_matrix_shape(shape):
    """[rows, cols] for a gradient: conv kernels [..., in, out] -> [prod(... in), out]."""
    dims = shape.as_list()
    rows = 1
    for d in dims[:-1]:
        rows *= d
    return rows, dims[-1]


class PowerSGD(Compressor):
    """Low-rank gradients: ``rank`` columns in P (n x r) and Q (m x r) per n x m matrix.

    Per step and matrix M (gradient plus residual): P = M Q, allreduce P,
    orthonormalise P, Q = M^T P, allreduce Q, M ~ P Q^T: two small
    allreduces (all P's fused, then all Q's). ``warm_start`` keeps Q for the
    next step (better approximations at the same cost); ``error_feedback``
    keeps M - P Q^T per rank. Before ``start_step`` gradients go dense (the
    early steps change fast). Conv kernels are reshaped to matrices; a 1-D
    tensor cannot be factored and stays dense (noted once).
    """

    name = "PowerSGD"

    def __init__(self, rank: int, start_step: int = 0, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 4321,
                 min_size: int | None = None) -> None:
        super().__init__(DEFAULT_MIN_SIZE if min_size is None else min_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError("PowerSGD rank must be a whole number >= 1, not %r" % (rank,))
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError("PowerSGD start_step must be a whole number >= 0, not %r"
                             % (start_step,))
        self.rank = rank
        self.start_step = start_step
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.memory = ErrorFeedback()
        self._q = PerVariable()   # Q per matrix, dropped with its variable
        self._noted = set()

    def selects(self, item: Item) -> bool:
        size = item.size
        if size is None or size < self.min_size:
            return False
        if item.grad.shape.rank < 2:
            if item.name not in self._noted:
                self._noted.add(item.name)
                log.info("PowerSGD: %s is %d-D, not a matrix: it is sent dense",
                         item.name, item.grad.shape.rank)
            return False
        return True

    def _rank_of(self, item):
        n, m = as_matrix_shape(item.grad.shape)
        return min(self.rank, n, m)

    def shared_variables(self) -> list[tf.Variable]:
        return super().shared_variables() + self._q.values()   # Q: the same on every rank

    def _q_variable(self, i, item):
        _, m = as_matrix_shape(item.grad.shape)
        r, dtype = self._rank_of(item), item.grad.dtype

        def start():   # the same on every rank
            return tf.random.stateless_normal([m, r], [self.seed, i], dtype=dtype)

        return self._q.get(item, start)

    def reduce(self, items: Sequence[Item], op: str,
               threshold: int) -> tuple[list[tf.Tensor], list[int]]:
        for it in items:
            check_float(it, self.name)
        step = self.step()
        names = [it.name for it in items]
        low_rank_bytes = [self._bytes(it) for it in items]
        dense_bytes = [it.size * it.grad.dtype.size for it in items]
        if self.start_step == 0:
            return self._low_rank(items, op, threshold, step), low_rank_bytes

        def dense():
            return _fusion.allreduce_gradients([it.grad for it in items], op, threshold, names)

        if tf.executing_eagerly():
            if int(step) < self.start_step:
                return dense(), dense_bytes
            return self._low_rank(items, op, threshold, step), low_rank_bytes
        early = step < self.start_step
        out = tf.cond(early, dense, lambda: self._low_rank(items, op, threshold, step))
        sent = [tf.where(early, tf.constant(d, tf.int64), tf.constant(s, tf.int64))
                for d, s in zip(dense_bytes, low_rank_bytes)]
        return list(out), sent

    def _bytes(self, it):
        n, m = as_matrix_shape(it.grad.shape)
        return (n + m) * self._rank_of(it) * it.grad.dtype.size

    def _low_rank(self, items, op, threshold, step):
        names = [it.name for it in items]
        ms, qs = [], []
        for i, it in enumerate(items):
            n, m = as_matrix_shape(it.grad.shape)
            mat = tf.reshape(it.grad, [n, m])
            if self.error_feedback:
                mat = mat + tf.reshape(self.memory.residual(it), [n, m])
            ms.append(mat)
            qs.append(self._q_variable(i, it))
        ps = _fusion.allreduce_gradients([tf.matmul(mat, q) for mat, q in zip(ms, qs)], op,
                                         threshold, [n + "/P" for n in names])
        ps = [tf.linalg.qr(p).q for p in ps]   # same input on every rank: same basis
        new_qs = _fusion.allreduce_gradients(
            [tf.matmul(mat, p, transpose_a=True) for mat, p in zip(ms, ps)], op, threshold,
            [n + "/Q" for n in names])
        out = []
        for i, (it, mat, p, q_new) in enumerate(zip(items, ms, ps, new_qs)):
            approx = tf.matmul(p, q_new, transpose_b=True)
            if self.error_feedback:
                self.memory.residual(it).assign(tf.reshape(mat - approx, it.grad.shape))
            if self.warm_start:
                qs[i].assign(q_new)
            else:
                seed = tf.stack([tf.constant(self.seed + i, tf.int64), step])
                qs[i].assign(tf.random.stateless_normal(q_new.shape, seed, dtype=q_new.dtype))
            out.append(tf.reshape(approx, it.grad.shape))
        return out

    def __repr__(self):
        return "PowerSGD(%d, start_step=%d, warm_start=%s, error_feedback=%s)" % (
            self.rank, self.start_step, self.warm_start, self.error_feedback)
