"""The weights a training run went through, for PCA directions and projections.

``TrajectoryRecorder`` is a Keras callback that keeps the flattened trainable
weights at the start of training and after every epoch (or every ``every``
steps) in memory, and in an HDF5 file when given a ``path`` (dataset
``weights``, shape ``(records, parameters)``, appended and flushed per
record; written by rank 0 only: data-parallel training keeps the weights
equal on every rank).
"""

from __future__ import annotations

import os
from typing import Sequence

import keras
import numpy as np

from matex import _runtime
from matex.science import _directions


class TrajectoryRecorder(keras.callbacks.Callback):
    """Record the flattened trainable weights during ``fit``.

    Args:
      path: an HDF5 file to write (rank 0), or None to keep them in memory only.
      every: "epoch", or a number of training steps between records.
      dtype: the dtype records are kept in (float32 halves the memory).
    Attributes:
      weights: ``(records, parameters)`` array of what was recorded.
      steps: the global step of each record (0 = before training).
    """

    def __init__(self, path: str | None = None, every: str | int = "epoch",
                 dtype: str = "float32") -> None:
        super().__init__()
        if every != "epoch" and (isinstance(every, bool) or not isinstance(every, int)
                                 or every < 1):
            raise ValueError("every must be 'epoch' or a whole number of steps >= 1, not %r"
                             % (every,))
        self.path, self.every, self.dtype = path, every, np.dtype(dtype)
        self._records, self.steps = [], []
        self._step = 0
        self._file = None

    @property
    def weights(self) -> np.ndarray:
        return np.stack(self._records) if self._records else np.zeros((0, 0), self.dtype)

    def _record(self):
        flat = np.concatenate([np.asarray(v.numpy(), self.dtype).reshape(-1)
                               for v in self.model.trainable_weights])
        self._records.append(flat)
        self.steps.append(self._step)
        if self.path is not None and _runtime.rank() == 0:
            import h5py

            if self._file is None:
                self._file = h5py.File(self.path, "w")
                self._file.create_dataset("weights", shape=(0, flat.size),
                                          maxshape=(None, flat.size), dtype=self.dtype,
                                          chunks=(1, flat.size))
                self._file.create_dataset("steps", shape=(0,), maxshape=(None,), dtype="i8")
            w, s = self._file["weights"], self._file["steps"]
            w.resize(w.shape[0] + 1, axis=0)
            w[-1] = flat
            s.resize(s.shape[0] + 1, axis=0)
            s[-1] = self._step
            self._file.flush()

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._record()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._step += 1
        if self.every != "epoch" and self._step % self.every == 0:
            self._record()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.every == "epoch":
            self._record()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def load_trajectory(source: TrajectoryRecorder | str | os.PathLike | np.ndarray) -> np.ndarray:
    """The ``(records, parameters)`` weights of a ``TrajectoryRecorder``, its file, or an array."""
    if isinstance(source, TrajectoryRecorder):
        return source.weights
    if isinstance(source, str):
        import h5py

        with h5py.File(source, "r") as f:
            return f["weights"][...]
    return np.asarray(source)


def project_trajectory(trajectory: TrajectoryRecorder | str | os.PathLike | np.ndarray,
                       vectors: Sequence,
                       origin: np.ndarray | Sequence | None = None) -> np.ndarray:
    """Coordinates of recorded weights in the span of ``vectors`` around ``origin``.

    Args:
      trajectory: a ``TrajectoryRecorder``, its HDF5 file, or a ``(records,
        parameters)`` array.
      vectors: directions, each flat or a list of arrays shaped like the
        trainable weights (e.g. a surface's ``(d1, d2)``, or the eigenvectors
        from ``hessian_eigenvalues(..., return_vectors=True)``).
      origin: the point the coordinates are measured from (flat or per
        weight); default: the last record (the final weights).
    Returns:
      ``(records, len(vectors))`` least-squares coordinates.
    """
    data = load_trajectory(trajectory)
    flat = [np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in v])
            if isinstance(v, (list, tuple)) else np.asarray(v, np.float64).reshape(-1)
            for v in vectors]
    if origin is None:
        origin = data[-1]
    elif isinstance(origin, (list, tuple)):
        origin = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in origin])
    for v in flat:
        if v.size != data.shape[1]:
            raise ValueError("matex.science: a direction has %d entries, the trajectory "
                             "records %d parameters" % (v.size, data.shape[1]))
    return _directions.project(data, flat, origin)
