"""Make Keras 3 itself distributed (``import matex.keras`` / ``python -m matex``).

``install()`` patches Keras classes in place, so ``keras``, ``tf.keras`` and
``matex.keras`` behave alike:

* ``compile`` wraps the optimizer in ``DistributedOptimizer``; any optimizer
  used in a custom loop becomes distributed on its first ``apply``. A script
  that wrapped its optimizer itself is taken to shard its own data: its
  ``fit``/``evaluate``/``predict`` keep their inputs (output stays rank 0's).
* ``fit``/``evaluate`` shard their inputs (``_sharding``: the script's batch is
  the global batch; gradients are weighted by rows so N ranks follow the
  single-process trajectory); ``predict`` splits array inputs and gathers the
  predictions in order.
* metrics are exact global values: metric *states* are summed over ranks
  before each ``result()`` (states are assumed additive: totals, counts,
  confusion counts — true of Keras's built-in metrics).
* only rank 0 shows progress, runs file-writing callbacks, and saves; loading
  reads the file on rank 0 and broadcasts it.
* ``MATEX_SCALING=weak`` (or ``fit(..., scaling="weak")``) keeps the per-rank
  batch, multiplies the learning rate by the number of ranks and warms it up
  linearly over the first epoch (Goyal et al., 2017); the script's rate is
  back when ``fit`` returns, so repeated fits do not compound. A
  ``LearningRateSchedule`` cannot be scaled: a clear error.
* shuffling: arrays and ``PyDataset`` batch orders are permuted by MaTEx with
  a seed shared by all ranks (Keras gets ``shuffle=False``); the script's own
  randomness is seeded alike on every rank (``_transparent``).
"""

import functools
import importlib
import inspect
import os
import tempfile
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from matex import _checkpoint, _collectives, _fusion, _optimizer, _runtime, _sharding

_lock = threading.Lock()
_installed = False
_WRITERS = ("ModelCheckpoint", "CSVLogger", "TensorBoard", "ProgbarLogger", "RemoteMonitor")


def _bind(function, *args, **kwargs):
    """Arguments of a call, all named (edit ``.arguments``, call with ``_call``)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _call(function, bound):
    return function(*bound.args, **bound.kwargs)


def _shared_seed():
    """A shuffling seed drawn from NumPy's global generator: rank 0's, on every rank.

    Every rank draws (generators that agree keep agreeing); rank 0's value
    is used everywhere, so a script seeded per rank still shuffles one way.
    A seeded script shuffles reproducibly; an unseeded one differently every
    run (transparent mode seeds NumPy from fresh entropy, see _transparent).
    """
    mine = int(np.random.randint(2 ** 31 - 1))
    return _runtime.comm().bcast(mine, root=0)


def _shuffles_itself(x):
    """Whether MaTEx, not Keras, shuffles ``fit``'s input ``x`` when ``shuffle=True``."""
    return _sharding.is_array_input(x) or isinstance(x, keras.utils.PyDataset)


def _present(*parts):
    return tuple(p for p in parts if p is not None)


def _shard_input(x, y, sample_weight, batch_size, shuffle, seed, epoch=0):
    """(x, y, sample_weight, batch_size) to pass to Keras for this rank.

    Arrays and ``PyDataset`` batches are shuffled here, with permutations from
    ``(seed, epoch)`` shared by all ranks (Keras must then get shuffle=False).
    """
    if x is None:
        return x, y, sample_weight, batch_size
    if isinstance(x, tf.data.Dataset):
        return _sharding.shard(x), y, sample_weight, None
    if isinstance(x, keras.utils.PyDataset):
        if getattr(x, _sharding.SHARDED_ATTR, False):
            return x, y, sample_weight, None
        return _sharding.shard_pydataset(x, shuffle, seed, epoch), y, sample_weight, None
    if inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        return _sharding.shard_generator(x), y, sample_weight, None
    if _sharding.is_array_input(x):
        arrays = _present(x, y, sample_weight)
        shards = _sharding.ArrayShards(arrays, batch_size or 32, shuffle, seed)
        return shards.dataset(), None, None, None
    return x, y, sample_weight, batch_size


def _rank0_callbacks(callbacks):
    """Callbacks for this rank: file writers and progress only on rank 0."""
    if not isinstance(callbacks, (list, tuple)) or _runtime.rank() == 0:
        return callbacks   # includes Keras's own CallbackList, already filtered
    kept = []
    for cb in callbacks:
        name = type(cb).__name__
        if name in _WRITERS:
            continue
        if name == "BackupAndRestore":   # restores everywhere, writes on rank 0
            cb._save_model = lambda *a, **k: None
            cb.on_train_end = lambda logs=None: None
        kept.append(cb)
    return kept


def _quiet(verbose):
    return verbose if _runtime.rank() == 0 else 0


def _explicit(model, original, args, kwargs):
    """For explicitly distributed models: only rank-0 output; data untouched."""
    bound = _bind(original, model, *args, **kwargs)
    bound.arguments["verbose"] = _quiet(bound.arguments["verbose"])
    bound.arguments["callbacks"] = _rank0_callbacks(bound.arguments["callbacks"])
    return _call(original, bound)


class _TrainInput:
    """``fit``'s training input, re-creatable for the current ranks from any step."""

    def __init__(self, x, y, sample_weight, batch, shuffle, seed):
        self.raw = (x, y, sample_weight, batch, shuffle, seed)
        self.shards = None
        self.steps = None
        if _sharding.is_array_input(x):
            self.shards = _sharding.ArrayShards(_present(x, y, sample_weight), batch, shuffle,
                                                seed)
            self.steps = self.shards.steps
        elif isinstance(x, tf.data.Dataset) and int(x.cardinality()) > 0:
            self.steps = int(x.cardinality())

    def at(self, epoch, step):
        """(x, y, sample_weight, batch_size) for Keras, starting at (epoch, step)."""
        x, y, sw, batch, shuffle, seed = self.raw
        if self.shards is not None:
            return self.shards.dataset(epoch, step), None, None, None
        if step and self.steps:
            x = x.skip(step)
        elif step:
            raise RuntimeError(
                "cannot resume training after a rank failure: fit's input is not re-iterable "
                "from a given step (use arrays or a tf.data dataset of known length)")
        return _shard_input(x, y, sw, batch, shuffle, seed, epoch)


class _AverageMovingStatistics(keras.callbacks.Callback):
    """Average BatchNormalization's moving statistics over ranks.

    Each rank updates them from its own slice of the global batch. Their
    update is linear (``m = momentum*m + (1-momentum)*batch_value``), so
    averaging the ranks' statistics once per epoch, after its training steps
    (before validation, else at the epoch's end), equals averaging them after
    every step: the moving mean is then the single-process one (equal
    slices), the moving variance the mean of the slices' variances. Every
    rank ends with the same values.
    """

    trained = False   # steps ran since the last average

    def on_epoch_begin(self, epoch, logs=None):
        self.trained = True

    def on_test_begin(self, logs=None):
        self._average()

    def on_epoch_end(self, epoch, logs=None):
        self._average()

    def _average(self):
        if not self.trained:
            return
        self.trained = False
        stats = [v for layer in self.model._flatten_layers()
                 if isinstance(layer, keras.layers.BatchNormalization) and layer.built
                 for v in (layer.moving_mean, layer.moving_variance)]
        if stats and _runtime.size() > 1:
            for v, mean in zip(stats, _collectives.grouped_allreduce(
                    [tf.convert_to_tensor(v) for v in stats], "average")):
                v.assign(mean)


def _snapshot(variables):
    """Values to restore ``variables`` to later, taken cheaply.

    Small variables are copied. Large ones are read as tensors that share the
    variable's buffer: TensorFlow copies a variable's buffer before updating it
    while such a read is held (copy on write), so a large variable the step
    does not change (a frozen layer's weights) costs no copy at all.
    """
    return [v.numpy() if int(np.prod(v.shape)) * v.value.dtype.size < _COPY_BELOW_BYTES
            else tf.convert_to_tensor(v) for v in variables]


_COPY_BELOW_BYTES = 64 << 10


class _StepSnapshot(keras.callbacks.Callback):
    """Per step: the non-trainable state to restore if the step is redone; faults at 'begin'."""

    def __init__(self, track):
        super().__init__()
        self.track = track
        self.iterations = None
        self.values = []

    def on_train_batch_begin(self, batch, logs=None):
        iterations = int(self.model.optimizer.iterations)
        if self.track:
            self.iterations = iterations
            self.values = _snapshot(self.model.non_trainable_variables)
        from matex import _faults

        _faults.maybe_fail(iterations, "begin")

    def restore_if_not_applied(self):
        """Undo this rank's partial step (the update did not happen)."""
        if self.iterations is not None and int(self.model.optimizer.iterations) == self.iterations:
            for v, value in zip(self.model.non_trainable_variables, self.values):
                v.assign(value)


def _resync_after_failure(model, snapshot, first_iteration, initial_epoch, steps):
    """Adopt the new rank 0's state; return the (epoch, step) to resume from."""
    from matex import _resilience

    snapshot.restore_if_not_applied()
    optimizer = model.optimizer
    state = list(model.variables) + (list(optimizer.variables) if optimizer.built else [])
    _collectives.broadcast_variables(state, 0)
    done = int(optimizer.iterations) - first_iteration
    done = _runtime.comm().bcast(done, root=0)
    _resilience.check_replicas([v.numpy() for v in state])
    if steps is None:
        raise RuntimeError("cannot resume training after a rank failure: the number of "
                           "steps per epoch of fit's input is unknown")
    return initial_epoch + done // steps, done % steps


def _merge_histories(histories):
    merged = histories[-1]
    merged.epoch = [e for h in histories for e in h.epoch]
    keys = {k for h in histories for k in h.history}
    merged.history = {k: [v for h in histories for v in h.history.get(k, [])] for k in keys}
    return merged


_announced = False


def _fit(original):
    @functools.wraps(original)
    def fit(self, *args, scaling=None, **kwargs):
        global _announced
        if getattr(self, "_matex_explicit", False):
            return _explicit(self, original, args, kwargs)
        from matex import _resilience
        from matex.callbacks import (BroadcastGlobalVariablesCallback,
                                     LearningRateWarmupCallback, check_learning_rate_settable)

        bound = _bind(original, self, *args, **kwargs)
        a = bound.arguments
        scaling = scaling or os.environ.get("MATEX_SCALING", "strong")
        if scaling not in ("strong", "weak"):
            raise ValueError("scaling must be 'strong' or 'weak', not %r" % scaling)
        size = _runtime.size()
        batch = a["batch_size"] or 32
        if scaling == "weak":
            batch *= size
        x, y, sw = a["x"], a["y"], a["sample_weight"]
        if (a["validation_split"] and a["validation_data"] is None
                and _sharding.is_array_input(x)):
            from keras.src.trainers.data_adapters import array_slicing

            (x, y, sw), a["validation_data"] = array_slicing.train_validation_split(
                _present(x, y, sw) + (None,) * (3 - len(_present(x, y, sw))),
                validation_split=a["validation_split"])
            a["validation_split"] = 0.0
        shuffle = bool(a["shuffle"]) and _shuffles_itself(x)
        train = _TrainInput(x, y, sw, batch, shuffle, _shared_seed() if shuffle else 0)
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
        if os.environ.get("MATEX_CHECKPOINT_DIR"):
            from matex._checkpoint import AtomicBackupAndRestore

            callbacks.append(AtomicBackupAndRestore(os.environ["MATEX_CHECKPOINT_DIR"]))
        ft = _resilience.mode() == "ulfm"
        snapshot = _StepSnapshot(track=ft)
        if not _announced and _runtime.rank() == 0 and (ft or size > 1):
            print(_resilience.describe_mode(), flush=True)
            _announced = True
        verbose, epochs = a["verbose"], a["epochs"]
        first_iteration = int(self.optimizer.iterations) if self.optimizer is not None else 0
        start_epoch = a["initial_epoch"]
        epoch, step, histories = start_epoch, 0, []
        self._matex_weighted = True
        while epoch < epochs:
            a["x"], a["y"], a["sample_weight"], a["batch_size"] = train.at(epoch, step)
            if isinstance(a["x"], (tf.data.Dataset, keras.utils.PyDataset)):
                # shuffled by MaTEx (the same on every rank), or the dataset's
                # own business: Keras would shuffle PyDataset batches with each
                # rank's own `random`
                a["shuffle"] = False
            if validation is not None:
                if isinstance(validation, (tuple, list)) and _sharding.is_array_input(
                        validation[0]):
                    vx, vy, vsw = (tuple(validation) + (None, None))[:3]
                    a["validation_data"] = _shard_input(vx, vy, vsw, vbatch, False, 0)[0]
                else:
                    a["validation_data"] = _shard_input(validation, None, None, vbatch,
                                                        False, 0)[0]
            a["initial_epoch"] = epoch
            a["epochs"] = epoch + 1 if step else epochs
            a["verbose"] = _quiet(verbose)
            a["callbacks"] = _rank0_callbacks(
                [BroadcastGlobalVariablesCallback(0), snapshot, _AverageMovingStatistics()]
                + callbacks)
            try:
                histories.append(_call(original, bound))
                epoch, step = a["epochs"], 0
            except Exception as exc:  # noqa: BLE001 - classified right below
                if not (ft and _resilience.is_failure(exc)):
                    raise
                loss = _resilience.recover()
                resync_started = time.time()
                epoch, step = _resync_after_failure(self, snapshot, first_iteration,
                                                    start_epoch, train.steps)
                loss.resync_seconds = time.time() - resync_started
                _resilience.notify(loss)
                if _runtime.rank() == 0:
                    print("matex: lost rank(s) %s; %d ranks continue from epoch %d step %d "
                          "(recovered in %.3f s + %.3f s re-sync)"
                          % (loss.lost, loss.new_size, epoch + 1, step, loss.seconds,
                             loss.resync_seconds), flush=True)
                _tell_callbacks(callbacks, loss)
        return _merge_histories(histories) if histories else self.history

    return fit


def _tell_callbacks(callbacks, loss):
    """Call ``on_rank_loss(loss)`` on the script's callbacks that define it."""
    for cb in callbacks or ():
        if hasattr(cb, "on_rank_loss"):
            cb.on_rank_loss(loss)


def _redo_after_failure(model, run, callbacks):
    """``run()``, started over on the survivors if a rank fails during it (ULFM).

    For work that changes no weights (evaluate, predict): after a recovery
    the survivors take rank 0's weights and simply run it again, re-divided;
    ``callbacks`` that define ``on_rank_loss`` hear of it as in ``fit``.
    """
    from matex import _resilience

    while True:
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if _resilience.mode() != "ulfm" or not _resilience.is_failure(exc):
                raise
            loss = _resilience.recover()
            started = time.time()
            _collectives.broadcast_variables(model.variables, 0)
            _resilience.check_replicas([v.numpy() for v in model.variables], "model weights")
            loss.resync_seconds = time.time() - started
            _resilience.notify(loss)
            _tell_callbacks(callbacks, loss)


def _evaluate(original):
    @functools.wraps(original)
    def evaluate(self, *args, **kwargs):
        if getattr(self, "_matex_explicit", False):
            return _explicit(self, original, args, kwargs)
        bound = _bind(original, self, *args, **kwargs)
        a = bound.arguments
        data = (a["x"], a["y"], a["sample_weight"], a["batch_size"] or 32)
        callbacks = a["callbacks"]

        def run():
            if getattr(self, "optimizer", None) is not None:
                from matex import _faults

                _faults.maybe_fail(int(self.optimizer.iterations), "evaluate")
            a["x"], a["y"], a["sample_weight"], a["batch_size"] = _shard_input(*data, False, 0)
            a["verbose"] = _quiet(a["verbose"])
            a["callbacks"] = _rank0_callbacks(callbacks)
            return _call(original, bound)

        return _redo_after_failure(self, run, callbacks)

    return evaluate


def _predict(original):
    @functools.wraps(original)
    def predict(self, *args, **kwargs):
        if getattr(self, "_matex_explicit", False):
            return _explicit(self, original, args, kwargs)
        bound = _bind(original, self, *args, **kwargs)
        a = bound.arguments
        x, callbacks = a["x"], a["callbacks"]

        def run():
            a["verbose"] = _quiet(a["verbose"])
            a["callbacks"] = _rank0_callbacks(callbacks)
            if not _sharding.is_array_input(x) or _runtime.size() == 1:
                return _call(original, bound)
            arrays = tf.nest.map_structure(np.asarray, x)
            n = len(tf.nest.flatten(arrays)[0])
            lo, hi = _sharding.slice_bounds(n, _runtime.rank(), _runtime.size())
            a["x"] = tf.nest.map_structure(lambda v: v[lo:hi], arrays)
            mine = _call(original, bound)
            pieces = _runtime.comm().allgather(mine)
            return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *pieces)

        return _redo_after_failure(self, run, callbacks)

    return predict


def _train_step(original):
    @functools.wraps(original)
    def train_step(self, data):
        if not getattr(self, "_matex_weighted", False):
            return original(self, data)
        with _optimizer.rows_of_step(self.optimizer, data):
            return original(self, data)

    return train_step


def _get_metrics_result(original):
    @functools.wraps(original)
    def get_metrics_result(self):
        variables = [v for m in self.metrics for v in m.variables]
        if not variables:
            return original(self)
        local = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        total = _fusion.allreduce_gradients(local, "sum", threshold=1 << 30)
        for v, t in zip(variables, total):
            v.assign(t)
        result = tf.nest.map_structure(tf.identity, original(self))
        with tf.control_dependencies(tf.nest.flatten(result)):
            for v, t in zip(variables, local):
                v.assign(t)
        return result

    return get_metrics_result


def _compile(original):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        given = _bind(original, self, *args, **kwargs).arguments.get("optimizer")
        # An optimizer the script wrapped itself means the script shards its
        # own data (explicit use): fit/evaluate/predict then leave data alone.
        self._matex_explicit = _optimizer.is_distributed(given)
        result = original(self, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None:
            self.optimizer = _optimizer.DistributedOptimizer(self.optimizer)
        return result

    return compile


def _optimizer_apply(original):
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if _optimizer.is_distributed(self):
            return original(self, grads, trainable_variables)
        _optimizer.DistributedOptimizer(self)
        return self.apply(grads, trainable_variables)

    return apply


def _rank0_write(original):
    # No barrier: saving is often called on rank 0 alone (a checkpoint
    # callback), and loading reads on rank 0 and broadcasts, so no rank ever
    # needs to wait for the file.
    @functools.wraps(original)
    def write(*args, **kwargs):
        return original(*args, **kwargs) if _runtime.rank() == 0 else None

    return write


def _load_model(original):
    @functools.wraps(original)
    def load_model(filepath, *args, **kwargs):
        comm = _runtime.comm()
        payload = None
        if comm.Get_rank() == 0:
            try:
                with open(filepath, "rb") as f:
                    payload = (True, f.read())
            except OSError as exc:
                payload = (False, "%s: %s" % (type(exc).__name__, exc))
        ok, data = comm.bcast(payload, root=0)
        if not ok:
            raise OSError("cannot read %s on rank 0: %s" % (filepath, data))
        if comm.Get_rank() == 0:
            return original(filepath, *args, **kwargs)
        suffix = os.path.splitext(str(filepath))[1]
        with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
            tmp.write(data)
            tmp.flush()
            return original(tmp.name, *args, **kwargs)

    return load_model


def _load_weights(original):
    @functools.wraps(original)
    def load_weights(self, *args, **kwargs):
        comm = _runtime.comm()
        result, error = None, None
        if comm.Get_rank() == 0:
            try:
                result = original(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                error = exc
        failure = comm.bcast(None if error is None else "%s: %s" % (type(error).__name__, error),
                             root=0)
        if error is not None:
            raise error
        if failure is not None:
            raise OSError("cannot load weights on rank 0: %s" % failure)
        _collectives.broadcast_variables(self.variables, 0)
        return result

    return load_weights


def _patch(owner, name, wrapper):
    original = getattr(owner, name)
    if getattr(original, "_matex_original", None) is not None:
        return
    patched = wrapper(original)
    patched._matex_original = original
    setattr(owner, name, patched)


def install():
    """Patch Keras so that every script using it trains distributed (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        import keras
        from keras.src.backend.tensorflow import trainer as tf_trainer
        from keras.src.models import model as model_module
        from keras.src.optimizers import base_optimizer
        from keras.src.saving import saving_api
        from keras.src.trainers import trainer

        _runtime.init()
        from matex import _resilience, _transparent

        _transparent.seed_script_rngs()   # once; python -m matex did it before the script

        if _resilience.mode() == "ulfm":
            _resilience.install_excepthook()
        _optimizer._patch_keras_trainer()
        _patch(trainer.Trainer, "compile", _compile)
        _patch(trainer.Trainer, "get_metrics_result", _get_metrics_result)
        _patch(tf_trainer.TensorFlowTrainer, "fit", _fit)
        _patch(tf_trainer.TensorFlowTrainer, "evaluate", _evaluate)
        _patch(tf_trainer.TensorFlowTrainer, "predict", _predict)
        _patch(tf_trainer.TensorFlowTrainer, "train_step", _train_step)
        _patch(base_optimizer.BaseOptimizer, "apply", _optimizer_apply)
        _patch(model_module.Model, "save_weights", _rank0_write)
        _patch(model_module.Model, "load_weights", _load_weights)
        _patch(keras.callbacks.BackupAndRestore, "on_train_begin",
               lambda original: _checkpoint.restore_on_train_begin)
        original_save = saving_api.save_model
        original_load = saving_api.load_model
        _patch(saving_api, "save_model", _rank0_write)
        _patch(saving_api, "load_model", _load_model)
        namespaces = [keras.saving, keras.models]
        for name in ("keras._tf_keras.keras.saving", "keras._tf_keras.keras.models"):
            try:
                namespaces.append(importlib.import_module(name))
            except ImportError:
                pass
        for namespace in namespaces:
            if getattr(namespace, "save_model", None) is original_save:
                namespace.save_model = saving_api.save_model
            if getattr(namespace, "load_model", None) is original_load:
                namespace.load_model = saving_api.load_model
        _installed = True
