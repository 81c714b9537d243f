"""``fit``: the script's batch is the global batch; every rank trains on its slice.

The whole call runs inside the recovery loop (``matex._recovery.run``): after
a rank failure the survivors restore and re-synchronise the model's state and
go on from the first step the new rank 0 had not applied, with the rest of
the epoch re-divided among them.
"""

import functools

import keras
import tensorflow as tf

from matex import _compat, _config, _faults, _recovery, _resilience, _runtime, _batch_slicing
from matex._keras import inputs, metrics
from matex._keras.calls import bind, call
from matex._keras.metrics import AverageMovingStatistics
from matex._keras.output import explicit, quiet, rank0_callbacks
from matex.errors import MismatchError, is_mismatch


class _StepBegin(keras.callbacks.Callback):
    """Per step: snapshot what a redone step must start from (under ULFM); faults at 'begin'.

    Also counts the steps this rank finished in the current epoch, to name a
    rank whose data ran out early (``_check_equal_steps``).
    """

    def __init__(self, states):
        super().__init__()
        self.states = states or []
        self.epoch, self.steps = 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.steps = epoch, 0

    def on_train_batch_begin(self, batch, logs=None):
        for state in self.states:
            state.begin_step()
        _faults.maybe_fail(int(self.model.optimizer.iterations), "begin")

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def _check_equal_steps(error, step_begin):
    """Turn a collective mismatch caused by unequal step counts into a clear error.

    When one rank's data runs out before another's (a ``.filter`` after
    sharding, say), its end-of-epoch reduction of the metrics meets the other
    ranks' next gradient allreduce: the agreement check fails on every rank,
    so every rank gets here and can say whether its data had ended. Returns
    the error to raise.
    """
    if not is_mismatch(error):
        return error
    ended = metrics.summing_after_data
    metrics.summing_after_data = False
    everyone = _runtime.control().allgather((ended, step_begin.steps))
    if len({e for e, _ in everyone}) == 1:
        return error   # a mismatch of another kind
    return MismatchError(
        "matex: ranks ran different numbers of training steps in epoch %d: %s. The training "
        "data gives the ranks different numbers of batches, so their collectives no longer "
        "match. A .filter() (or any transformation that drops or adds batches) applied after "
        "matex.shard() or to a matex.readers dataset does this: filter samples before "
        "batching and sharding, so that every rank keeps one slice of every global batch."
        % (step_begin.epoch + 1, "; ".join(
            "rank %d %s after %d steps" % (r, "had no batch left" if e else "had more", n)
            for r, (e, n) in enumerate(everyone))))


def _merge_histories(histories):
    merged = histories[-1]
    merged.epoch = [e for h in histories for e in h.epoch]
    keys = {k for h in histories for k in h.history}
    merged.history = {k: [v for h in histories for v in h.history.get(k, [])] for k in keys}
    return merged


_announced = False


def _observers(global_batch):
    """The timeline's and the monitor's callbacks, when asked for (else none: no cost).

    They come before the script's callbacks, so that ``TensorBoard`` sees the
    monitor's epoch figures.
    """
    from matex import timeline
    from matex.callbacks import MonitorCallback, TimelineCallback

    out = []
    if timeline.requested():
        out.append(TimelineCallback())
    if _config.monitor():
        out.append(MonitorCallback(global_batch))
    return out


def _announce(size, ft):
    global _announced
    if not _announced and _runtime.rank() == 0 and (ft or size > 1):
        print(_resilience.describe_mode(), flush=True)
        _announced = True


def fit(original):
    @functools.wraps(original)
    def fit(self, *args, scaling=None, **kwargs):
        if getattr(self, "_matex_explicit", False):
            bound = bind(original, self, *args, **kwargs)
            given = bound.arguments["batch_size"]   # None for a dataset: steps/s instead
            observers = _observers(given * _runtime.size() if given else None)
            if observers:
                bound.arguments["callbacks"] = observers + list(bound.arguments["callbacks"]
                                                                or [])
                args, kwargs = bound.args[1:], bound.kwargs
            try:
                return explicit(self, original, args, kwargs)
            except Exception as exc:
                _resilience.veto_failure(exc)   # e.g. a model-parallel grid's RankFailure
                raise
        from matex.callbacks import (BroadcastGlobalVariablesCallback,
                                     LearningRateWarmupCallback, check_learning_rate_settable)

        bound = bind(original, self, *args, **kwargs)
        a = bound.arguments
        scaling = _config.scaling(scaling)
        size = _runtime.size()
        batch = a["batch_size"] or 32
        if scaling == "weak":
            batch *= size
        x, y, sw = a["x"], a["y"], a["sample_weight"]
        if (a["validation_split"] and a["validation_data"] is None
                and _batch_slicing.is_array_input(x)):
            given = inputs.present(x, y, sw)
            (x, y, sw), a["validation_data"] = _compat.train_validation_split(
                given + (None,) * (3 - len(given)), a["validation_split"])
            a["validation_split"] = 0.0
        shuffle = bool(a["shuffle"]) and inputs.shuffles_itself(x)
        train = inputs.TrainInput(x, y, sw, batch, shuffle, inputs.shared_seed() if shuffle else 0)
        validation = a["validation_data"]
        vbatch = a["validation_batch_size"] or batch
        a["validation_batch_size"] = None
        callbacks = list(a["callbacks"] or [])
        if scaling == "weak" and size > 1:
            check_learning_rate_settable(self.optimizer, "fit(scaling='weak')")
            # ramps from the script's rate (never an already scaled one) and
            # puts it back when fit ends: repeated fits do not compound
            callbacks.append(LearningRateWarmupCallback(warmup_epochs=1, multiplier=size,
                                                        restore_on_train_end=True))
        if _config.checkpoint_dir():
            from matex._keras.checkpoint import AtomicBackupAndRestore

            callbacks.append(AtomicBackupAndRestore(_config.checkpoint_dir()))
        observers = _observers(batch)
        ft = _resilience.mode() == "ulfm"
        state = _recovery.model_state(self, track_steps=ft)
        # the optimizer's own (Local SGD's rollback, delay=1's request in flight)
        states = [state] + _recovery.optimizer_states(self.optimizer, state.variables)
        step_begin = _StepBegin(states if ft else None)
        _announce(size, ft)
        verbose, epochs = a["verbose"], a["epochs"]
        first_iteration = int(self.optimizer.iterations) if self.optimizer is not None else 0
        start_epoch = a["initial_epoch"]
        position = {"epoch": start_epoch, "step": 0}
        histories = []
        self._matex_weighted = True

        def body():
            while position["epoch"] < epochs:
                epoch, step = position["epoch"], position["step"]
                a["x"], a["y"], a["sample_weight"], a["batch_size"] = train.at(epoch, step)
                if isinstance(a["x"], (tf.data.Dataset, keras.utils.PyDataset)):
                    # shuffled by MaTEx (the same on every rank), or the dataset's
                    # own business: Keras would shuffle PyDataset batches with each
                    # rank's own `random`
                    a["shuffle"] = False
                if validation is not None:
                    a["validation_data"] = inputs.validation_input(validation, vbatch)
                a["initial_epoch"] = epoch
                a["epochs"] = epoch + 1 if step else epochs
                a["verbose"] = quiet(verbose)
                a["callbacks"] = rank0_callbacks(
                    [BroadcastGlobalVariablesCallback(0), step_begin, AverageMovingStatistics()]
                    + train.callbacks() + observers + callbacks)
                try:
                    histories.append(call(original, bound))
                except tf.errors.InvalidArgumentError as exc:
                    clear = _check_equal_steps(exc, step_begin)
                    if clear is exc:
                        raise
                    raise clear from exc
                position["epoch"], position["step"] = a["epochs"], 0

        def resume_point(loss):
            if train.steps is None:
                raise RuntimeError("cannot resume training after a rank failure: the number "
                                   "of steps per epoch of fit's input is unknown")
            # the optimizer's step counter came from the new rank 0 with its state
            done = int(self.optimizer.iterations) - first_iteration
            position["epoch"] = start_epoch + done // train.steps
            position["step"] = done % train.steps
            if _runtime.rank() == 0:
                print("matex: lost rank(s) %s; %d ranks continue from epoch %d step %d "
                      "(recovered in %.3f s)" % (loss.lost, loss.new_size, position["epoch"] + 1,
                                                 position["step"], loss.seconds), flush=True)

        _recovery.run(body, states, on_recovered=resume_point, callbacks=callbacks)
        return _merge_histories(histories) if histories else self.history

    return fit
