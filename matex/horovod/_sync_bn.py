"""Horovod's ``SyncBatchNormalization`` on Keras 3's ``BatchNormalization(synchronized=True)``."""

from __future__ import annotations

from typing import Any

import keras


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training statistics are those of the global batch.

    Horovod's signature (``fused`` must be False; the default name is
    ``sync_batch_normalization``) on MaTEx's synchronised BatchNormalization:
    one fused allreduce of every rank's (rows, sum, sum of squares), so the
    mean and variance are the whole global batch's, weighted by each rank's
    rows: a rank with 0 rows adds nothing (Horovod averages the ranks'
    moments with equal weights, which is the same only when every rank has
    the same rows). Gradients flow through the other ranks' statistics, and
    every rank updates its moving statistics with the same global moments.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name", None):
            kwargs["name"] = "sync_batch_normalization"
        kwargs.pop("synchronized", None)   # from get_config: always synchronised
        super().__init__(synchronized=True, **kwargs)


def _global_batch_moments(self, inputs, mask):
    """This layer's own moments: the global batch's over MaTEx's ranks (one allreduce).

    Explicit: only this class; plain ``BatchNormalization`` layers are not touched. One
    process, a ``tf.distribute`` strategy, or a ``mask`` (Keras's masked moments, never
    synchronised) take Keras's own computation.
    """
    import tensorflow as tf

    from matex import _compat, _runtime
    from matex._keras import batchnorm

    if mask is not None or _runtime.size() == 1 or tf.distribute.has_strategy():
        return getattr(keras.layers.BatchNormalization, _compat.BATCHNORM_MOMENTS)(
            self, inputs, mask)
    return batchnorm.global_moments(inputs, _compat.batchnorm_reduction_axes(self))


def _override_moments():
    from matex import _compat

    setattr(SyncBatchNormalization, _compat.BATCHNORM_MOMENTS, _global_batch_moments)


_override_moments()
