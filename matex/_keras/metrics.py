"""Exact global metrics, and BatchNormalization's moving statistics averaged over ranks.

The metrics are reduced when they are read, not in every step: a step that
``fit`` or ``evaluate`` traces returns this rank's values and makes no
collective for them (``lazy_reduction``). The epoch's and the call's figures
are read eagerly at their end (Keras's ``get_metrics_result``), which sums the
states over ranks; per-batch logs carry the global values every few batches
(``GlobalLogs``). Where a script's callback may read every batch's logs, the
step sums them itself, as one more collective in the graph: an eager sum after
every step costs more (``benchmarks/small_models.py``).
"""

import functools
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from matex import _collectives, _compat, _config, _fusion, _optimizer, _runtime, _state
from matex._keras.calls import bind, call


_now = _state.namespace(
    "keras.metrics", "process",
    # True while an eager (end-of-loop) reduction of metric states is under way: a
    # rank found there by a collective mismatch ran out of batches before the others
    summing_after_data=False,
    reading_batch=False,   # read_global under way: not the end of a rank's data
)

_lazy = _state.local("keras.metrics.lazy")   # .active: fit/evaluate read the metrics when needed
_LAZY_MARK = "_matex_lazy_logs"   # on a model whose steps return local metric values


class lazy_reduction:
    """Within this block, steps traced for ``fit``/``evaluate`` leave the metrics local
    (``active``), or sum them in the step (not ``active``: every batch's logs are read,
    and one more collective in the step costs less than an eager sum after it).

    A model whose step functions were traced the other way traces them anew.
    """

    def __init__(self, model, active: bool = True):
        self.active = active
        if getattr(model, _LAZY_MARK, None) not in (None, active):
            _compat.forget_step_functions(model)

    def __enter__(self):
        self.before = getattr(_lazy, "active", False)
        _lazy.active = self.active
        return self

    def __exit__(self, *exc):
        _lazy.active = self.before


def _pythonify(value):
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array


def read_global(model) -> dict:
    """The model's metrics summed over ranks (a collective), for per-batch logs."""
    _now.reading_batch = True
    try:
        return {k: _pythonify(v) for k, v in model.get_metrics_result().items()}
    finally:
        _now.reading_batch = False


def get_metrics_result(original):
    """Sum every metric's state over ranks around ``result()``, then put the local state back.

    States are assumed additive (totals, counts, confusion counts — true of
    Keras's built-in metrics), so the result is the global one. In a step traced
    for ``fit``/``evaluate`` (``lazy_reduction``) the local result is returned
    and the model is marked: its logs are made global when read.
    """
    @functools.wraps(original)
    def result(self):
        variables = [v for m in self.metrics for v in m.variables]
        if not variables or _runtime.size() == 1:   # one rank: local is global
            return original(self)
        if not tf.executing_eagerly():   # a step traced: the way it reduces is marked
            lazy = getattr(_lazy, "active", False)
            object.__setattr__(self, _LAZY_MARK, lazy)
            if lazy:
                return original(self)
        if _optimizer.in_compiled_part():   # jit_compile: summed by the step, outside XLA
            _optimizer.defer_to_outer_step()
            return original(self)
        local = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        # fit/evaluate's end, after the last batch (not a batch's logs being read)
        _now.summing_after_data = tf.executing_eagerly() and not _now.reading_batch
        total = _fusion.allreduce_gradients(local, "sum", threshold=1 << 30)
        _now.summing_after_data = False
        for v, t in zip(variables, total):
            v.assign(t)
        value = tf.nest.map_structure(tf.identity, original(self))
        with tf.control_dependencies(tf.nest.flatten(value)):
            for v, t in zip(variables, local):
                v.assign(t)
        return value

    return result


def reads_global_metrics(model) -> bool:
    """Whether ``model``'s steps return local metric values (traced lazily)."""
    return getattr(model, _LAZY_MARK, False)


def _overrides(callback, name: str) -> bool:
    method = getattr(callback, name, None)
    return getattr(method, "__func__", method) is not getattr(keras.callbacks.Callback, name)


def batch_log_interval(callbacks, verbose) -> Optional[int]:
    """Every how many batches the per-batch logs need the global metrics, or None.

    ``callbacks``: the script's own (before rank 0's writers are set apart, so
    the answer is the same on every rank). A callback with a batch-end hook may
    read every batch's logs: every batch. TensorBoard and ModelCheckpoint read
    them at their own frequency. The progress bar (``verbose`` 1 or "auto")
    every ``MATEX_METRICS_EVERY`` batches. None: no batch needs them.
    """
    every = None

    def want(n):
        nonlocal every
        every = n if every is None else min(every, n)

    for cb in callbacks or []:
        if isinstance(cb, keras.callbacks.TensorBoard):
            freq = getattr(cb, "update_freq", "epoch")
            if isinstance(freq, int) and freq > 0:
                want(freq)
        elif isinstance(cb, keras.callbacks.ModelCheckpoint):
            if getattr(cb, "save_freq", "epoch") != "epoch":
                want(1)
        elif isinstance(cb, keras.callbacks.BackupAndRestore):
            pass   # saves state, reads no metric
        elif isinstance(cb, keras.callbacks.ProgbarLogger):
            want(_config.metrics_every())
        elif any(_overrides(cb, hook) for hook in
                 ("on_batch_end", "on_train_batch_end", "on_test_batch_end")):
            want(1)
    if verbose in (1, "auto"):
        want(_config.metrics_every())
    return every


def on_batch(original):
    """``train_on_batch``/``test_on_batch``: the metrics they return are the global ones,
    read after the step when it was traced lazily (for ``fit``/``evaluate``)."""
    @functools.wraps(original)
    def on_batch(self, *args, **kwargs):
        bound = bind(original, self, *args, **kwargs)
        as_dict = bound.arguments["return_dict"]
        bound.arguments["return_dict"] = True
        logs = call(original, bound)
        if reads_global_metrics(self) and isinstance(logs, dict):
            logs.update({k: v for k, v in read_global(self).items() if k in logs})
        return logs if as_dict else _compat.flatten_metrics_in_order(self, logs)

    return on_batch


class GlobalLogs(keras.callbacks.Callback):
    """Per-batch logs with the exact global metrics, read every ``every`` (> 1) batches.

    MaTEx's first callback on every rank: the steps return local metric values
    (``lazy_reduction``); at the first batch and then every ``every`` batches it
    sums the metric states over ranks (one small allreduce) and writes the
    global values into the logs; between, the logs carry the last global ones.
    ``every`` None: batch logs are not read (the epoch's figures are exact anyway).
    """

    def __init__(self, every: Optional[int]):
        super().__init__()
        self.every = every
        # every batch: the step sums them itself (lazy_reduction(model, False))
        self.lazy = every != 1
        self.last = {}    # "train"/"test" -> the last global values
        self.since = {}   # batches since they were read

    def on_epoch_begin(self, epoch, logs=None):
        self.last.pop("train", None)

    def on_test_begin(self, logs=None):
        self.last.pop("test", None)

    def on_train_batch_end(self, batch, logs=None):
        self._fill("train", logs)

    def on_test_batch_end(self, batch, logs=None):
        self._fill("test", logs)

    def _fill(self, kind, logs):
        if (self.every is None or not self.lazy or not isinstance(logs, dict)
                or not reads_global_metrics(self.model)):
            return
        self.since[kind] = self.since.get(kind, 0) + 1
        if kind not in self.last or self.since[kind] >= self.every:
            self.last[kind], self.since[kind] = read_global(self.model), 0
        for key, value in self.last[kind].items():
            if key in logs:
                logs[key] = value


class AverageMovingStatistics(keras.callbacks.Callback):
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
        stats = [v for layer in _compat.flatten_layers(self.model)
                 if isinstance(layer, keras.layers.BatchNormalization) and layer.built
                 and not layer.synchronized   # those are equal on every rank already
                 for v in (layer.moving_mean, layer.moving_variance)]
        if stats and _runtime.size() > 1:
            for v, mean in zip(stats, _collectives.grouped_allreduce(
                    [tf.convert_to_tensor(v) for v in stats], "average")):
                v.assign(mean)
