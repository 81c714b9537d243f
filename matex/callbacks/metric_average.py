"""Epoch-end logs averaged over ranks, for scripts that distribute by hand."""

import keras
import numpy as np

from matex import _runtime


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end logs over ranks (for training without ``matex.keras``,
    whose metrics are already exact global values)."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], np.float64)
        total = np.empty_like(values)
        from mpi4py import MPI

        _runtime.control().Allreduce(values, total, op=MPI.SUM)
        for k, v in zip(keys, total / _runtime.size()):
            logs[k] = float(v)
