"""Adasum: adaptive summation of gradients (Maleki et al., MLSys 2021).

Two gradients combine as

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector is zero): orthogonal gradients add,
parallel ones average. Each tensor of a group is one "layer": its dot product
and norms are its own, whatever other tensors travel with it.

Order of combination (the result depends on it; every rank gets the same):

* ``P`` ranks, ``P`` a power of two: a binary tree over ranks in order,
  Adasum(Adasum(g0, g1), Adasum(g2, g3)) for 4 ranks, computed by vector
  halving and distance doubling: at level ``L`` (1, 2, 4, ...) rank ``r``
  exchanges half of the part it holds with rank ``r ^ L``, combines the half
  it keeps, and the dot products and norms of those partial vectors are
  summed over the ``2L`` ranks that share the pair (recursive doubling of a
  ``3 x tensors`` float64 vector); then the parts travel back (distance
  halving) until every rank holds the whole result. Each rank moves about
  2 x the tensor's bytes, as in a ring allreduce.
* Any other count ``N = P + E`` (``P`` the largest power of two below ``N``):
  the first ``2E`` ranks fold in pairs first (rank ``2i + 1`` sends its
  tensor to rank ``2i``, which combines them: Adasum(g_2i, g_2i+1)); the ``P``
  partial results, in rank order, then combine by the tree above, and rank
  ``2i`` sends the result back to ``2i + 1``. For 3 ranks:
  Adasum(Adasum(g0, g1), g2). (Horovod refuses a non-power-of-two count.)

Dot products and norms are float64; a combined vector is computed in float64
and rounded once to the tensor's dtype (float16, bfloat16, float32 or
float64) at each level, as it is sent in that dtype. The transfers are
``matex.parallel`` send/receive ops on one tag, so this works eagerly and in
``tf.function``; rank and size are read when the function is traced
(MaTEx's recovery retraces the train step after a shrink). Shapes must be
fully defined; one small allreduce first checks that every rank has the
same dtype and sizes, else every rank raises ``tf.errors.InvalidArgumentError``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from matex import _runtime
from matex._issue import _as_tensor, _issue, _ops
from matex._runtime import _run_as_is

FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
TAG = 8190   # p2p channel of Adasum transfers (the pipeline uses 17, the streamed save 0x5e17)


def layout(rank: int, size: int) -> tuple[int, int, int | None]:
    """(P, E, v): the power of two P <= size, the E = size - P folded pairs, and
    ``rank``'s place v in the power-of-two tree (None: it folded into rank - 1)."""
    power = 1
    while power * 2 <= size:
        power *= 2
    extra = size - power
    if rank < 2 * extra:
        return power, extra, (rank // 2 if rank % 2 == 0 else None)
    return power, extra, rank - extra


def _real(v, extra):
    """The rank holding place ``v`` of the power-of-two tree."""
    return 2 * v if v < extra else v + extra


def _p2p():
    from matex.parallel import _p2p   # lazily: only Adasum needs matex.parallel

    return _p2p


PIECES = 16   # at most this many tensors in a part: per-tensor reductions, else segment sums


def _combine(left, right, seg, k, dtype, block_sum):
    """cl * left + cr * right per tensor, with dot products and norms summed by ``block_sum``.

    ``seg`` (NumPy, non-decreasing) names each element's tensor; the stats
    vector is ``[dot, |left|^2, |right|^2]`` for each of the ``k`` tensors,
    zero for tensors absent from this part (every rank of a block sends it).
    """
    a = tf.cast(left, tf.float64)
    b = tf.cast(right, tf.float64)
    ids, starts = np.unique(seg, return_index=True)
    sizes = np.diff(np.append(starts, len(seg))).tolist()
    if len(ids) == 0:
        block_sum(tf.zeros([3 * k], tf.float64))   # the block's peers wait for this part's sums
        return tf.cast(a, dtype)
    few = len(ids) <= PIECES
    if few:
        pa = tf.split(a, sizes) if len(ids) > 1 else [a]
        pb = tf.split(b, sizes) if len(ids) > 1 else [b]
        local = tf.stack([tf.stack([tf.reduce_sum(x * y), tf.reduce_sum(x * x),
                                    tf.reduce_sum(y * y)]) for x, y in zip(pa, pb)])
    else:
        rel = tf.constant(np.repeat(np.arange(len(ids), dtype=np.int32), sizes))
        local = tf.stack([tf.math.segment_sum(a * b, rel), tf.math.segment_sum(a * a, rel),
                          tf.math.segment_sum(b * b, rel)], 1)
    if len(ids) < k:
        local = tf.scatter_nd(tf.constant(ids[:, None], tf.int32), local, [k, 3])
    stats = tf.reshape(block_sum(tf.reshape(local, [-1])), [k, 3])
    stats = tf.gather(stats, tf.constant(ids, tf.int32)) if len(ids) < k else stats
    dot, anorm, bnorm = stats[:, 0], stats[:, 1], stats[:, 2]
    one = tf.ones_like(dot)
    ca = tf.where(anorm > 0, 1.0 - dot / (2.0 * tf.where(anorm > 0, anorm, one)), one)
    cb = tf.where(bnorm > 0, 1.0 - dot / (2.0 * tf.where(bnorm > 0, bnorm, one)), one)
    if few:
        out = [ca[i] * x + cb[i] * y for i, (x, y) in enumerate(zip(pa, pb))]
        out = tf.concat(out, 0) if len(out) > 1 else out[0]
    else:
        out = tf.repeat(ca, sizes) * a + tf.repeat(cb, sizes) * b
    return tf.cast(out, dtype)


def _adasum_flat(flat, seg, k, rank, size, comm):
    """Adasum of the 1-D ``flat`` over the ranks of slot ``comm`` (module docstring)."""
    p2p = _p2p()
    dtype = flat.dtype
    n = int(flat.shape[0])
    power, extra, v = layout(rank, size)
    if v is None:   # folded: hand the tensor to rank - 1, get the result back
        p2p.send(flat, rank - 1, comm=comm, tag=TAG)
        return p2p.recv([n], dtype, rank - 1, comm=comm, tag=TAG)
    folded = rank < 2 * extra
    if folded:
        other = p2p.recv([n], dtype, rank + 1, comm=comm, tag=TAG)
        flat = _combine(flat, other, seg, k, dtype, lambda s: s)

    def block_sum(stats, level, v=v):
        # recursive doubling over the 2 * level places sharing this level's pair;
        # x + y == y + x exactly, so every rank of the block gets the same sums
        m = 1
        while m <= level:
            peer = _real(v ^ m, extra)
            stats = stats + p2p.sendrecv(stats, peer, peer, [3 * k], tf.float64,
                                         comm=comm, tag=TAG)
            m *= 2
        return stats

    buf, lo, hi = flat, 0, n        # buf holds [lo, hi) of the whole vector
    steps = []
    level = 1
    while level < power:
        peer = _real(v ^ level, extra)
        half = (hi - lo) // 2
        left = (v & level) == 0
        if left:   # keep the first half, send the second
            keep, give, new = buf[:half], buf[half:], (lo, lo + half)
        else:
            keep, give, new = buf[half:], buf[:half], (lo + half, hi)
        got = p2p.sendrecv(give, peer, peer, [new[1] - new[0]], dtype, comm=comm, tag=TAG)
        pair = (keep, got) if left else (got, keep)   # (lower places' vector, upper's)
        steps.append((peer, left, (hi - lo) - (new[1] - new[0])))
        lo, hi = new
        buf = _combine(pair[0], pair[1], seg[lo:hi], k, dtype,
                       lambda s, level=level: block_sum(s, level))
        level *= 2
    for peer, left, missing in reversed(steps):   # distance halving: gather the parts back
        got = p2p.sendrecv(buf, peer, peer, [missing], dtype, comm=comm, tag=TAG)
        buf = tf.concat([buf, got] if left else [got, buf], 0)
    if folded:
        p2p.send(buf, rank + 1, comm=comm, tag=TAG)
    return buf


def _check(tensor, what):
    tensor = _as_tensor(tensor, what)
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError("matex.%s with op='adasum' needs a floating-point tensor (%s), not %s"
                        % (what, ", ".join(d.name for d in FLOAT_DTYPES), tensor.dtype.name))
    if not tensor.shape.is_fully_defined():
        raise ValueError("matex.%s with op='adasum' needs a fully defined shape, got %s"
                         % (what, tensor.shape))
    return tensor


def _agree(tensors, counts, comm):
    """An op that fails on every rank (InvalidArgumentError) unless all agree on dtype and sizes.

    One small collective first, so that a disagreement is one error everywhere
    instead of a failed transfer on some ranks and a wait on the others.
    """
    meta = tf.constant([tensors[0].dtype.as_datatype_enum] + counts, tf.int64)
    both = _issue(_ops().matex_allreduce, tf.concat([meta, -meta], 0), reduce_op="max",
                  comm=int(comm), name=None)
    k = len(counts) + 1
    return tf.debugging.assert_equal(
        both[:k], -both[k:], message="matex.allreduce(op='adasum'): ranks disagree on the "
        "dtype or the sizes of the tensors (max over ranks vs min: dtype enum, sizes)")


def _group(tensors, comm):
    """Adasum of same-dtype ``tensors``, one fused vector, per-tensor coefficients."""
    c = _runtime.slot_comm(comm)
    rank, size = c.Get_rank(), c.Get_size()
    if size == 1:
        return [tf.identity(t) for t in tensors]
    counts = [int(t.shape.num_elements()) for t in tensors]
    seg = np.repeat(np.arange(len(tensors), dtype=np.int32), counts)
    with tf.control_dependencies([_agree(tensors, counts, comm)]):
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    out = _adasum_flat(flat, seg, len(tensors), rank, size, int(comm))
    parts = tf.split(out, counts) if len(tensors) > 1 else [out]
    return [tf.reshape(part, t.shape) for part, t in zip(parts, tensors)]


def _scale(tensor, factor):
    """``tensor * factor``, float16/bfloat16 computed in float32 (Horovod's scale factors)."""
    if factor == 1.0:
        return tensor
    compute = tf.float32 if tensor.dtype in (tf.float16, tf.bfloat16) else tensor.dtype
    return tf.cast(tf.cast(tensor, compute) * tf.constant(factor, compute), tensor.dtype)


@_run_as_is
def adasum(tensor: tf.Tensor, name: str | None = None, comm: int = 0,
           prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """``matex.allreduce(tensor, op="adasum")``: the Adasum of every rank's ``tensor``.

    ``prescale_factor`` multiplies each rank's tensor first, ``postscale_factor``
    the result.
    """
    return grouped_adasum([tensor], name or "matex_adasum", comm,
                          prescale_factor, postscale_factor, what="allreduce")[0]


@_run_as_is
def grouped_adasum(tensors: Sequence[tf.Tensor], name: str | None = None,
                   comm: int = 0, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, what: str = "grouped_allreduce"
                   ) -> list[tf.Tensor]:
    """``matex.grouped_allreduce(tensors, op="adasum")``: each tensor combined as its own layer.

    Tensors of one dtype travel together (one fused vector); dtypes go one
    after another, in order of first appearance.
    """
    tensors = [_scale(_check(t, what), float(prescale_factor)) for t in tensors]
    out: list = [None] * len(tensors)
    order: dict = {}
    for i, t in enumerate(tensors):
        order.setdefault(t.dtype, []).append(i)
    with tf.name_scope(name or "matex_grouped_adasum"):
        for at in order.values():
            for i, r in zip(at, _group([tensors[i] for i in at], comm)):
                out[i] = _scale(r, float(postscale_factor))
    return out
