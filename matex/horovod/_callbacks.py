"""Horovod's Keras callbacks, with Horovod's signatures and behaviour, on Keras 3."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import keras

from matex import _collectives, _runtime
from matex.callbacks import BroadcastGlobalVariablesCallback as _MatexBroadcast
from matex.callbacks import MetricAverageCallback as _MatexMetricAverage
from matex.callbacks import check_learning_rate_settable
from matex.legacy._keras2 import (Keras2Callback, has_momentum_hyperparameter, is_keras2,
                                  optimizer_variables)

_log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(Keras2Callback, _MatexBroadcast):
    """At the start of training, give every rank rank ``root_rank``'s variables.

    The model's variables and the optimizer's (when built), except those in
    ``local_variables``. Horovod broadcasts after the first batch; this runs
    before it (MaTEx's optimizer state is built by then when it exists), so
    the first step already starts from the same weights everywhere.
    """

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: Iterable[Any] | None = None) -> None:
        super().__init__(root_rank)
        self.root_rank = root_rank
        self.device = device
        self.local_variables = list(local_variables or [])

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._done:
            return
        local = {id(v) for v in self.local_variables}
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and is_keras2(optimizer):   # its slots, once made
            variables += optimizer_variables(optimizer)
        elif optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        _collectives.broadcast_variables([v for v in variables if id(v) not in local],
                                         self.root_rank)
        self._done = True


class MetricAverageCallback(Keras2Callback, _MatexMetricAverage):
    """Average the epoch-end metrics over ranks (``device`` is ignored: MPI on the host)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device


class LearningRateScheduleCallback(Keras2Callback, keras.callbacks.Callback):
    """The learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    Horovod's callback: ``multiplier`` is a number (then ``staircase``) or a
    function of the epoch; with ``staircase`` the rate changes at each
    epoch's start, else at each batch with a fractional epoch
    (``epoch + batch / steps_per_epoch``). ``initial_lr`` None reads the
    optimizer's rate when training begins. ``momentum_correction`` is
    applied as Horovod does (the momentum scaled by new/old rate for the batch
    whose rate changed) only to tf-keras's legacy optimizers, whose momentum
    is a variable of the step: a Keras 3 optimizer's momentum is a constant
    of its compiled step. The epoch logs get ``lr``.
    """

    def __init__(self, initial_lr: float | None, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 *args: Any) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if not callable(multiplier):
            self.staircase = True
            factor = float(multiplier)
            self.multiplier: Callable[[float], float] = lambda epoch: factor
        else:
            self.multiplier = multiplier

    def _in_range(self, epoch: int | None) -> bool:
        return epoch is not None and epoch >= self.start_epoch and (
            self.end_epoch is None or epoch < self.end_epoch)

    def _adjust_learning_rate(self, epoch: float) -> None:
        assert self.initial_lr is not None   # set by on_train_begin
        optimizer = self.model.optimizer
        old = float(optimizer.learning_rate)
        optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)
        if self.momentum_correction and old and has_momentum_hyperparameter(optimizer):
            # Horovod's momentum correction (Goyal et al.): momentum scaled by new/old rate
            # for this batch, restored at its end (Keras 2 optimizers whose momentum is a
            # variable of the step: tf-keras's legacy ones)
            self._restore_momentum = float(optimizer.momentum)
            optimizer.momentum = self._restore_momentum * float(optimizer.learning_rate) / old

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if getattr(self, "_restore_momentum", None) is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        check_learning_rate_settable(self.model.optimizer, type(self).__name__)
        if self.initial_lr is None:
            self.initial_lr = float(self.model.optimizer.learning_rate)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError("%s could not find the number of steps per epoch: pass "
                                 "steps_per_epoch" % type(self).__name__)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not self._in_range(epoch):
            self.current_epoch = None
            return
        self.current_epoch = epoch
        if self.staircase:
            self._adjust_learning_rate(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.staircase or not self._in_range(self.current_epoch):
            return
        assert self.current_epoch is not None and self.steps_per_epoch
        self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod's warmup (Goyal et al., 2017): at fractional epoch ``e`` (counted
    at the end of each batch) the rate is ``initial_lr / size * (e * (size
    - 1) / warmup_epochs + 1)``; after the warmup the callback leaves the
    rate alone. With ``verbose`` rank 0 prints when the warmup ends.
    """

    def __init__(self, initial_lr: float | None, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0, *args: Any) -> None:
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

        def multiplier(epoch: float) -> float:
            # as Horovod: the epoch counted at the end of the batch, so epochs end on round values
            epoch += 1.0 / (self.steps_per_epoch or 1)
            n = _runtime.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _runtime.rank() == 0:
            print("\nEpoch %d: finished gradual learning rate warmup to %g."
                  % (epoch + 1, float(self.model.optimizer.learning_rate)))
