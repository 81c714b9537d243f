"""``horovod.tensorflow.keras.elastic``: ``KerasState`` and the elastic Keras callbacks.

``KerasState(model, optimizer, **objects)`` is ``TensorFlowKerasState``;
``run`` is ``matex.horovod.elastic.run``. The callbacks keep ``state.batch``
and ``state.epoch`` and commit the state as Horovod's do. One difference on
Keras 3: changing ``params['steps']`` no longer shortens an epoch, so the
first epoch after a recovery is not shortened by the batches already
committed in it (``UpdateBatchStateCallback``); call
``fit(epochs=epochs - state.epoch)`` (Horovod's pattern: ``UpdateEpochStateCallback``
adds the epochs of this ``fit`` to the ones already done, so ``initial_epoch=state.epoch``
would count them twice) and commit at epoch ends (or count steps with ``state.batch`` in a
custom loop) to redo nothing.
"""

from __future__ import annotations

from typing import Any

import keras

from matex.horovod.elastic import ObjectState, State, run, run_fn
from matex.horovod.tensorflow.elastic import TensorFlowKerasState, TensorFlowState
from matex.legacy._keras2 import Keras2Callback

__all__ = ["KerasState", "TensorFlowKerasState", "TensorFlowState", "ObjectState", "State",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "run", "run_fn"]


class KerasState(TensorFlowKerasState):
    """A Keras model and its optimizer, with further objects as attributes."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(Keras2Callback, keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at every epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(Keras2Callback, keras.callbacks.Callback):
    """Keep ``state.batch`` the number of the last batch done in the epoch (0 at its end)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(Keras2Callback, keras.callbacks.Callback):
    """Keep ``state.epoch`` the number of epochs done, counted across recoveries."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = getattr(state, "epoch", 0)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]
