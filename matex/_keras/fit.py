"""``fit``: the script's batch is the global batch; every rank trains on its slice.

The whole call runs inside the recovery loop (``matex._recovery.run``): after
a rank failure the survivors restore and re-synchronise the model's state and
go on from the first step the new rank 0 had not applied, with the rest of
the epoch re-divided among them.
"""

import functools
import logging

import keras
import tensorflow as tf

from matex import (_compat, _config, _faults, _recovery, _resilience, _runtime, _batch_slicing,
                   _state)
from matex._keras import checkpoint, inputs, metrics
from matex._keras.calls import bind, call
from matex._keras.metrics import AverageMovingStatistics
from matex._keras.output import explicit, quiet, rank0_callbacks
from matex.errors import MismatchError, is_mismatch

_log = logging.getLogger(__name__)


class _StepBegin(keras.callbacks.Callback):
    """Per step: snapshot what a redone step must start from (under ULFM); faults at 'begin'.

    Also counts the steps this rank finished in the current epoch, to name a
    rank whose data ran out early (``_check_equal_steps``).
    """

    def __init__(self, states):
        super().__init__()
        self.states = states or []
        self.epoch, self.steps = 0, 0
        self.ran = False   # whether a training step ran to its end on this rank

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.steps = epoch, 0

    def on_train_batch_begin(self, batch, logs=None):
        for state in self.states:
            state.begin_step()
        if _faults.pending():   # else no host read of the step counter per step
            _faults.maybe_fail(int(self.model.optimizer.iterations), "begin")

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        self.ran = True


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
    ended = metrics._now.summing_after_data
    metrics._now.summing_after_data = False
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


_now = _state.namespace("keras.fit", "process", announced=False)


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
    if not _now.announced and _runtime.rank() == 0 and (ft or size > 1):
        print(_resilience.describe_mode(), flush=True)
        _now.announced = True


def _iterations(model):
    optimizer = getattr(model, "optimizer", None)
    return int(optimizer.iterations) if optimizer is not None else 0


class _SharedSeed:
    """``fit``'s shuffling seed, agreed (rank 0's) at the start of every run of its body.

    Agreed inside the recovery loop, so that losing a rank, rank 0 included,
    while it is broadcast is recovered like any other failure. Each rank draws
    once; a rank that already holds the agreed seed offers it again, so a redo
    after training began keeps the permutation every survivor used.
    """

    def __init__(self):
        self.value = None

    def agree(self):
        if self.value is None:
            self.value = inputs.shared_seed()
        else:
            self.value = _runtime.control().bcast(self.value, root=0)
        return self.value


def _build_before_training(model, x, y, sample_weight):
    """Create the model's and the optimizer's variables now, eagerly (under ULFM).

    Keras creates them while tracing the first step otherwise, and a variable
    created in a trace has no value until that step first runs: a rank lost
    before then left the survivors holding different sets of values. Built
    here, before the first collective, every variable holds its value on
    every rank from the start, so recovery can broadcast them all.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    batch = None
    if isinstance(x, tf.data.Dataset):
        batch = x.element_spec
    elif _batch_slicing.is_array_input(x):
        batch = tuple(tf.nest.map_structure(lambda a: a[:1], part) if part is not None else None
                      for part in (x, y, sample_weight))
    if batch is not None:
        try:
            _compat.symbolic_build(model, batch)   # model, metrics, loss, optimizer
            return
        except (ValueError, RuntimeError, TypeError) as exc:
            # a model Keras cannot build from shapes alone (Python control flow on
            # values): it builds while the first step is traced, as without MaTEx
            _log.debug("matex: building %s before fit failed (%s); Keras builds it in the "
                       "first step", type(model).__name__, exc)
    if not optimizer.built and all(layer.built for layer in _compat.flatten_layers(model)):
        optimizer.build(model.trainable_variables)


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
        _faults.maybe_fail(_iterations(self), "fit")
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
        seed = _SharedSeed() if shuffle else None
        # the seed is agreed inside the recovery loop (rank 0 may be the one lost);
        # the number of steps, which resume_point needs, does not depend on it
        train = inputs.TrainInput(x, y, sw, batch, shuffle, 0)
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
        if ft:
            _build_before_training(self, x, y, sw)
        # the model's, then those that joined its optimizer (Local SGD's rollback,
        # delay=1's request in flight, a compressor's residuals)
        states = _recovery.model_states(self, track_steps=ft)
        step_begin = _StepBegin(states if ft else None)
        _announce(size, ft)
        verbose, epochs = a["verbose"], a["epochs"]
        # the script's callbacks decide, the same on every rank
        global_logs = metrics.GlobalLogs(metrics.batch_log_interval(callbacks, verbose))
        first_iteration = _iterations(self)
        per_epoch = a["steps_per_epoch"]
        start_epoch = a["initial_epoch"]
        position = {"epoch": start_epoch, "step": 0}
        histories = []
        self._matex_weighted = True

        attempts = []

        def body():
            nonlocal train
            if attempts and not step_begin.ran:
                # A rank was lost before this rank's first step ran to its end: its
                # trace may have been cut short, and TensorFlow refuses to create
                # in a later trace the variables the cut one did not (Keras
                # metrics'...): trace anew, locally (the trace has no collective
                # left: recovery marked the first-step broadcast done).
                _compat.forget_train_function(self)
            attempts.append(1)
            if seed is not None:
                train = inputs.TrainInput(x, y, sw, batch, shuffle, seed.agree())
            while position["epoch"] < epochs:
                epoch, step = position["epoch"], position["step"]
                done = _iterations(self) - first_iteration
                if per_epoch and train.steps is None and done and isinstance(x, tf.data.Dataset):
                    # steps_per_epoch over a dataset of no known length (repeated):
                    # Keras reads it as one stream across epochs; go on where the
                    # survivors' committed steps leave it
                    a["x"], a["y"], a["sample_weight"], a["batch_size"] = inputs.shard_input(
                        x.skip(done), y, sw, batch, False, 0, epoch)
                else:
                    a["x"], a["y"], a["sample_weight"], a["batch_size"] = train.at(epoch, step)
                if per_epoch:
                    a["steps_per_epoch"] = per_epoch - step
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
                    [global_logs, BroadcastGlobalVariablesCallback(0), step_begin,
                     AverageMovingStatistics()] + train.callbacks() + observers + callbacks)
                # Training moved on since fit began (a recovery, or the rest of an
                # epoch resumed mid-way): the state is newer than any checkpoint, so
                # backup callbacks must not restore one (and Keras keeps the epoch a
                # restore set, for ever: the position here decides).
                checkpoint.suppress_restore(self, _iterations(self) != first_iteration)
                _compat.set_initial_epoch(self, None)
                try:
                    with metrics.lazy_reduction(self, global_logs.lazy):
                        histories.append(call(original, bound))
                except tf.errors.InvalidArgumentError as exc:
                    clear = _check_equal_steps(exc, step_begin)
                    if clear is exc:
                        raise
                    raise clear from exc
                position["epoch"], position["step"] = a["epochs"], 0

        def resume_point(loss):
            steps = per_epoch or train.steps
            if steps is None:
                raise RuntimeError("cannot resume training after a rank failure: the number "
                                   "of steps per epoch of fit's input is unknown (give "
                                   "steps_per_epoch, or arrays or a dataset of known length)")
            if per_epoch and train.steps is not None and per_epoch != train.steps:
                raise RuntimeError(
                    "cannot resume training after a rank failure: steps_per_epoch=%d differs "
                    "from the %d batches of one pass over fit's input, so epochs and passes "
                    "do not line up (give steps_per_epoch=%d, leave it out, or repeat the "
                    "dataset)" % (per_epoch, train.steps, train.steps))
            # the optimizer's step counter came from the new rank 0 with its state
            done = int(self.optimizer.iterations) - first_iteration
            position["epoch"] = start_epoch + done // steps
            position["step"] = done % steps
            if _runtime.rank() == 0:
                print("matex: lost rank(s) %s; %d ranks continue from epoch %d step %d "
                      "(recovered in %.3f s)" % (loss.lost, loss.new_size, position["epoch"] + 1,
                                                 position["step"], loss.seconds), flush=True)

        try:
            _recovery.run(body, states, on_recovered=resume_point, callbacks=callbacks)
        finally:
            checkpoint.suppress_restore(self, False)
        return _merge_histories(histories) if histories else self.history

    return fit
