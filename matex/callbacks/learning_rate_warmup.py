"""Large-batch warmup: ramp the learning rate to ``multiplier`` x over the first epochs."""

import keras

from matex import _compat, _runtime


def check_learning_rate_settable(optimizer: keras.optimizers.Optimizer,
                                 what: str = "scaling the learning rate") -> None:
    """Raise a clear error if ``optimizer``'s learning rate is a schedule (not settable)."""
    from keras.optimizers.schedules import LearningRateSchedule

    rate = _compat.learning_rate_object(optimizer)
    if isinstance(rate, LearningRateSchedule):
        raise ValueError(
            "%s needs a settable learning rate, but this optimizer's is a %s. Scale the "
            "schedule yourself (e.g. its initial rate times matex.size(), with a warmup in the "
            "schedule), or use strong scaling (the default)."
            % (what, type(rate).__name__))


def _unscaled_learning_rate(optimizer):
    """The optimizer's learning rate before any warmup callback scaled it.

    A warmup callback records (base, value it set) on the optimizer; while the
    rate still holds that value, the base is the unscaled rate. If the script
    set another rate since, that one is the base.
    """
    current = float(optimizer.learning_rate)
    base, scaled = getattr(optimizer, "_matex_lr_scaling", (None, None))
    return base if base is not None and current == scaled else current


def _set_learning_rate(optimizer, base, value):
    optimizer.learning_rate = value
    object.__setattr__(optimizer, "_matex_lr_scaling", (base, float(optimizer.learning_rate)))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate linearly from ``lr`` to ``multiplier * lr``.

    ``lr`` is the optimizer's unscaled learning rate when training starts
    (the one the script set: a rate this callback scaled in an earlier
    ``fit`` is not scaled again); the ramp lasts ``warmup_epochs`` epochs
    (Goyal et al., 2017: large-batch training with a learning rate scaled by
    the number of ranks) and starts over in each ``fit`` that begins at
    epoch 0. ``multiplier`` defaults to the number of ranks. With
    ``restore_on_train_end`` the unscaled rate is put back when ``fit`` ends
    (MaTEx's weak scaling does this). A ``LearningRateSchedule`` cannot be
    scaled: a clear ``ValueError`` at the start of training.
    """

    def __init__(self, warmup_epochs: int = 1, multiplier: float | None = None,
                 steps_per_epoch: int | None = None, verbose: int = 0,
                 restore_on_train_end: bool = False) -> None:
        super().__init__()
        self.warmup_epochs = warmup_epochs
        self.multiplier = multiplier
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.restore_on_train_end = restore_on_train_end
        self._base = None
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = self.model.optimizer
        check_learning_rate_settable(optimizer, "LearningRateWarmupCallback")
        self._base = _unscaled_learning_rate(optimizer)
        if self.multiplier is None:
            self.multiplier = _runtime.size()
        self.steps_per_epoch = self.steps_per_epoch or self.params.get("steps") or 1

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        steps, base, multiplier = self.steps_per_epoch, self._base, self.multiplier
        assert steps and base is not None and multiplier is not None   # on_train_begin set them
        total = self.warmup_epochs * steps
        done = self._epoch * steps + batch + 1
        fraction = min(1.0, done / total)
        _set_learning_rate(self.model.optimizer, base, base * (1 + (multiplier - 1) * fraction))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.verbose and _runtime.rank() == 0 and epoch < self.warmup_epochs:
            print("matex: learning rate %.6g after warmup epoch %d"
                  % (float(self.model.optimizer.learning_rate), epoch + 1))

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.restore_on_train_end and self._base is not None:
            optimizer = self.model.optimizer
            optimizer.learning_rate = _unscaled_learning_rate(optimizer)
            object.__setattr__(optimizer, "_matex_lr_scaling", (None, None))
