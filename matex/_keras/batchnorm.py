"""``BatchNormalization(synchronized=True)``: batch statistics of the global batch.

Keras computes synchronised statistics only inside a ``tf.distribute``
strategy; under MaTEx (no strategy) its TensorFlow backend falls back to each
rank's own slice. ``install()`` replaces the one backend function that
computes synchronised moments, so that on several ranks they come from one
fused allreduce of every rank's (count, sum, sum of squares): the mean and
variance of the whole global batch, weighted by each rank's rows (a rank
with an empty slice adds nothing). The allreduce is differentiable, so the
gradient also flows through the other ranks' statistics, as in one process.

Numerics: each rank sums its values shifted by its first sample (float32
sums of numbers of the size of the spread, not of the mean), and the shift is
added back in float64 before the allreduce, so the global variance does not
suffer the float32 cancellation of E[x^2] - E[x]^2.

Gradient weights: ``fit`` weights each rank's gradient by its rows r/R (see
``_optimizer.rows_of_step``, published here by ``weighted_by``). The backward
pass of the statistics' allreduce then sums the ranks' incoming gradients
weighted by rows and divides by this rank's rows, so that after the
optimizer's row weighting the result is the exact global-batch gradient also
when slices differ (or one is empty). Outside a row-weighted step (custom
loops) the plain sum is used, which is exact for the optimizer's plain
average.

Layers without ``synchronized=True`` keep per-rank statistics (averaged over
ranks once per epoch by ``fit``, ``metrics.AverageMovingStatistics``). A rank
whose slice of a global batch is empty (17 rows in batches of 8 on 3 ranks:
the last batch has one row) leaves its moving statistics as they were
and gets zero gradients (``install`` patches ``BatchNormalization.call`` and
the backend's per-rank moments): Keras's moments of zero rows are 0/0 = NaN,
which it would fold into the moving mean and variance and into ``gamma``'s
gradient, and the per-epoch average and the gradient allreduce would carry
the NaN to every rank.
Inside a real ``tf.distribute`` strategy, and in a single process, Keras's own
function runs. Not covered: a call with a ``mask`` (Keras computes masked
moments itself, never synchronised) and XLA (``jit_compile=True``: the
allreduce has no XLA kernel, compilation fails naming ``MatexAllreduce``).
"""

import functools
import logging
import threading

import tensorflow as tf

from matex import _collectives, _compat, _runtime, _state

_log = logging.getLogger("matex")
_lock = threading.Lock()
_now = _state.namespace("keras.batchnorm", "process", installed=False)
# .stack: this rank's rows of the row-weighted steps being traced
_rows = _state.local("keras.batchnorm.rows")


# ---- synchronised moments ----------------------------------------------------

def _row_stack():
    stack = getattr(_rows, "stack", None)
    if stack is None:
        stack = _rows.stack = []
    return stack


def _step_rows():
    """This rank's rows in the row-weighted step being traced, or None."""
    stack = _row_stack()
    return stack[-1] if stack else None


def _sum_over_ranks(local, rows):
    """Allreduce ``local`` (sum); gradients weighted by ``rows`` when given (see module doc)."""
    if rows is None:
        return _collectives.allreduce(local, "sum")

    rows = tf.cast(rows, local.dtype)

    @tf.custom_gradient
    def summed(value):
        def grad(upstream):
            return tf.math.divide_no_nan(_collectives.allreduce(upstream * rows, "sum"), rows)

        return _collectives.allreduce(value, "sum"), grad

    return summed(local)


def _first_sample(x, axes, shape):
    """x's first value along ``axes`` (kept, size 1), per channel; 0 for an empty slice.

    The shift of the sums below: any value near the mean will do, and one
    sample is within a few standard deviations of it.
    """
    rank = x.shape.rank
    size = [tf.minimum(shape[i], 1) if i in axes else -1 for i in range(rank)]
    first = tf.slice(x, [0] * rank, tf.stack(size))
    return tf.reduce_sum(first, axes, keepdims=True)


def global_moments(x: tf.Tensor, axes, keepdims: bool = False):
    """Mean and variance of ``x`` over ``axes`` across the batch of all ranks.

    Collective: every rank must call it (one allreduce forward, one backward).
    """
    x = tf.convert_to_tensor(x)
    axes = [int(a) % max(x.shape.rank, 1) for a in axes]
    wide = tf.float64
    shape = tf.shape(x)
    count = tf.reduce_prod(tf.gather(shape, axes))
    shift = tf.stop_gradient(_first_sample(x, axes, shape))
    centred = x - shift
    shifted_sum = tf.cast(tf.reduce_sum(centred, axes, keepdims=True), wide)
    shifted_squares = tf.cast(tf.reduce_sum(tf.square(centred), axes, keepdims=True), wide)
    shift64, count64 = tf.cast(shift, wide), tf.cast(count, wide)
    # sum x = n c + sum (x - c); sum x^2 = sum (x - c)^2 + 2 c sum (x - c) + n c^2
    total = count64 * shift64 + shifted_sum
    squares = shifted_squares + 2.0 * shift64 * shifted_sum + count64 * tf.square(shift64)
    stats_shape = tf.shape(total)
    local = tf.concat([tf.reshape(count64, [1]), tf.reshape(total, [-1]),
                       tf.reshape(squares, [-1])], axis=0)
    summed = _sum_over_ranks(local, _step_rows())
    n = tf.size(total)
    global_count = summed[0]
    mean = tf.math.divide_no_nan(summed[1:1 + n], global_count)
    mean_square = tf.math.divide_no_nan(summed[1 + n:], global_count)
    variance = tf.maximum(mean_square - tf.square(mean), 0.0)
    mean = tf.cast(tf.reshape(mean, stats_shape), x.dtype)
    variance = tf.cast(tf.reshape(variance, stats_shape), x.dtype)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _moments_sync(original):
    def compute_moments_sync(x, axes, keepdims):
        if tf.distribute.has_strategy() or _runtime.size() == 1:
            return original(x, axes, keepdims)
        return global_moments(x, axes, keepdims)

    compute_moments_sync._matex_original = original
    return compute_moments_sync


# ---- which steps are row-weighted --------------------------------------------

class weighted_by:
    """Within this block the optimizer weights gradients by ``rows`` (this rank's rows).

    ``fit``'s train step enters it with the rows ``_optimizer.rows_of_step``
    weights by (None: not weighted).
    """

    def __init__(self, rows):
        self.rows = rows

    def __enter__(self):
        _row_stack().append(self.rows)
        return self

    def __exit__(self, *exc):
        _row_stack().pop()


# ---- an empty slice leaves the state alone ------------------------------------

def _moments_of_empty_are_zero(original):
    """Keras's per-rank moments, with 0 (not 0/0 = NaN) for an input with no values.

    On several ranks only (a slice can be empty there; one process keeps
    Keras's function as it is). Finite moments keep the normalisation of an
    empty slice, and so ``gamma``'s gradient (0 * NaN otherwise), finite;
    ``_keep_state_on_empty_batch`` keeps the moving statistics from taking
    them in.
    """
    def compute_moments(x, axes, keepdims):
        mean, variance = original(x, axes, keepdims)
        if _runtime.size() == 1:
            return mean, variance
        empty = tf.equal(tf.size(x), 0)
        return (tf.where(empty, tf.zeros_like(mean), mean),
                tf.where(empty, tf.zeros_like(variance), variance))

    compute_moments._matex_original = original
    return compute_moments


def _keep_state_on_empty_batch(original):
    """``BatchNormalization.call`` that leaves the layer's state as it was after an empty batch.

    The state (moving mean and variance; with ``renorm`` also its moving mean
    and standard deviation) is read before Keras updates it and selected
    back when the batch has no values. Plain reads and selects, no
    ``tf.cond`` (which traced the layer twice: 3x the trace time). Synchronised
    layers are left alone: their moments are the global batch's, the same
    on every rank, and every rank must apply them to stay equal. One process
    (whose batches are never empty) runs Keras's call unchanged.
    """
    @functools.wraps(original)
    def call(self, inputs, training=None, mask=None):
        if (not (training and self.trainable) or _runtime.size() == 1
                or self.synchronized):
            return original(self, inputs, training=training, mask=mask)
        state = list(self.non_trainable_variables)
        before = [tf.identity(v.value) for v in state]   # ordered before Keras's assigns
        outputs = original(self, inputs, training=training, mask=mask)
        empty = tf.equal(tf.size(inputs), 0)
        for v, old in zip(state, before):
            v.assign(tf.where(empty, old, v.value))
        return outputs

    return call


def install() -> None:
    """Make ``BatchNormalization(synchronized=True)`` synchronise over MaTEx ranks (idempotent).

    Also makes every ``BatchNormalization`` ignore an empty batch (see the module doc).
    """
    with _lock:
        if _now.installed:
            return
        nn = _compat.keras_tf_nn()
        name = _compat.MOMENTS_SYNC_NAME
        original = getattr(nn, name, None)
        if original is None:
            _log.warning("matex: this Keras has no %s.%s; BatchNormalization(synchronized=True) "
                         "uses per-rank statistics", nn.__name__, name)
        elif getattr(original, "_matex_original", None) is None:
            setattr(nn, name, _moments_sync(original))
        moments = getattr(nn, _compat.MOMENTS_NAME, None)
        if moments is not None and getattr(moments, "_matex_original", None) is None:
            setattr(nn, _compat.MOMENTS_NAME, _moments_of_empty_are_zero(moments))
        import keras

        from matex._keras.calls import patch

        patch(keras.layers.BatchNormalization, "call", _keep_state_on_empty_batch)
        _now.installed = True
