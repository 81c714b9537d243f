"""Keras 3 callbacks for data-parallel training (Horovod-style, working on Keras 3)."""

import keras
import numpy as np

from matex import _collectives, _runtime


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank rank ``root``'s model variables.

    Covers non-trainable variables (e.g. BatchNorm statistics) and the
    optimizer's state when it already exists. Added automatically by
    ``matex.keras``/``python -m matex``.
    """

    def __init__(self, root=0):
        super().__init__()
        self.root = root
        self._done = False

    def on_train_begin(self, logs=None):
        if self._done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        _collectives.broadcast_variables(variables, self.root)
        self._done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end logs over ranks (for training without ``matex.keras``,
    whose metrics are already exact global values)."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], np.float64)
        total = np.empty_like(values)
        from mpi4py import MPI

        _runtime.comm().Allreduce(values, total, op=MPI.SUM)
        for k, v in zip(keys, total / _runtime.size()):
            logs[k] = float(v)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate linearly from ``lr`` to ``multiplier * lr``.

    ``lr`` is the optimizer's learning rate when training starts; the ramp
    lasts ``warmup_epochs`` epochs (Goyal et al., 2017: large-batch training
    with a learning rate scaled by the number of ranks). ``multiplier``
    defaults to the number of ranks.
    """

    def __init__(self, warmup_epochs=1, multiplier=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.warmup_epochs = warmup_epochs
        self.multiplier = multiplier
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._base = None
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if self._base is None:
            self._base = float(self.model.optimizer.learning_rate)
        if self.multiplier is None:
            self.multiplier = _runtime.size()
        self.steps_per_epoch = self.steps_per_epoch or self.params.get("steps") or 1

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        total = self.warmup_epochs * self.steps_per_epoch
        done = self._epoch * self.steps_per_epoch + batch + 1
        fraction = min(1.0, done / total)
        self.model.optimizer.learning_rate = self._base * (1 + (self.multiplier - 1) * fraction)

    def on_epoch_end(self, epoch, logs=None):
        if self.verbose and _runtime.rank() == 0 and epoch < self.warmup_epochs:
            print("matex: learning rate %.6g after warmup epoch %d"
                  % (float(self.model.optimizer.learning_rate), epoch + 1))
