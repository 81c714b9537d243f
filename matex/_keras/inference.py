"""``evaluate`` and ``predict`` on every rank's share, with the full result on every rank.

Both run inside the recovery loop: after a rank failure the survivors take
rank 0's model and optimizer state and run the call again, re-divided (an
``evaluate`` nested in ``fit``'s validation re-reads its data instead of the
iterator ``fit`` cached for the old ranks).
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from matex import _compat, _faults, _recovery, _runtime, _batch_slicing
from matex._keras import inputs, metrics
from matex._keras.calls import bind, call
from matex._keras.output import explicit, quiet, rank0_callbacks


def evaluate(original):
    @functools.wraps(original)
    def evaluate(self, *args, **kwargs):
        if getattr(self, "_matex_explicit", False):
            return explicit(self, original, args, kwargs)
        bound = bind(original, self, *args, **kwargs)
        a = bound.arguments
        data = (a["x"], a["y"], a["sample_weight"], a["batch_size"] or 32)
        callbacks, verbose = a["callbacks"], a["verbose"]
        global_logs = metrics.GlobalLogs(metrics.batch_log_interval(
            callbacks if isinstance(callbacks, (list, tuple)) else [], verbose))
        attempts = []

        def body():
            if getattr(self, "optimizer", None) is not None:
                _faults.maybe_fail(int(self.optimizer.iterations), "evaluate")
            if attempts and a.get("kwargs"):
                # the iterator fit cached was cut for the ranks before the failure
                a["kwargs"].pop(_compat.EVALUATE_CACHED_KEYWORD, None)
            attempts.append(1)
            a["x"], a["y"], a["sample_weight"], a["batch_size"] = inputs.shard_input(
                *data, False, 0)
            a["verbose"] = quiet(verbose)
            a["callbacks"] = rank0_callbacks(callbacks)
            if isinstance(callbacks, keras.callbacks.CallbackList):
                return call(original, bound)   # fit's validation: fit's GlobalLogs and way
            a["callbacks"] = [global_logs] + list(a["callbacks"] or [])
            with metrics.lazy_reduction(self, global_logs.lazy):
                return call(original, bound)

        return _recovery.run(body, [_recovery.model_state(self, track_steps=False)],
                             callbacks=callbacks)

    return evaluate


def predict(original):
    @functools.wraps(original)
    def predict(self, *args, **kwargs):
        if getattr(self, "_matex_explicit", False):
            return explicit(self, original, args, kwargs)
        bound = bind(original, self, *args, **kwargs)
        a = bound.arguments
        x, callbacks = a["x"], a["callbacks"]

        def body():
            a["verbose"] = quiet(a["verbose"])
            a["callbacks"] = rank0_callbacks(callbacks)
            if not _batch_slicing.is_array_input(x) or _runtime.size() == 1:
                return call(original, bound)
            arrays = tf.nest.map_structure(np.asarray, x)
            n = len(tf.nest.flatten(arrays)[0])
            lo, hi = _batch_slicing.slice_bounds(n, _runtime.rank(), _runtime.size())
            if hi > lo or n == 0:
                a["x"] = tf.nest.map_structure(lambda v: v[lo:hi], arrays)
                mine = call(original, bound)
            else:
                # fewer rows than ranks: Keras cannot predict zero rows, so this
                # rank predicts one row and keeps none of it (right shapes, dtypes)
                a["x"] = tf.nest.map_structure(lambda v: v[:1], arrays)
                mine = tf.nest.map_structure(lambda v: v[:0], call(original, bound))
            pieces = _runtime.control().allgather(mine)
            return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *pieces)

        return _recovery.run(body, [_recovery.model_state(self, track_steps=False)],
                             callbacks=callbacks)

    return predict
