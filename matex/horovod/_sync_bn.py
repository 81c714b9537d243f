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
        from matex._keras import batchnorm

        batchnorm.install()   # BatchNormalization(synchronized=True) over MaTEx's ranks
        super().__init__(synchronized=True, **kwargs)
