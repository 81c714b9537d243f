"""Exact global metrics, and BatchNormalization's moving statistics averaged over ranks."""

import functools

import keras
import tensorflow as tf

from matex import _collectives, _compat, _fusion, _optimizer, _runtime


# True while an eager (end-of-loop) reduction of metric states is under way: a
# rank found there by a collective mismatch ran out of batches before the others
summing_after_data = False


def get_metrics_result(original):
    """Sum every metric's state over ranks around ``result()``, then put the local state back.

    States are assumed additive (totals, counts, confusion counts — true of
    Keras's built-in metrics), so the result is the global one.
    """
    @functools.wraps(original)
    def result(self):
        variables = [v for m in self.metrics for v in m.variables]
        if not variables:
            return original(self)
        if _optimizer.in_compiled_part():   # jit_compile: summed by the step, outside XLA
            _optimizer.defer_to_outer_step()
            return original(self)
        local = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        global summing_after_data
        summing_after_data = tf.executing_eagerly()   # fit/evaluate's end, after the last batch
        total = _fusion.allreduce_gradients(local, "sum", threshold=1 << 30)
        summing_after_data = False
        for v, t in zip(variables, total):
            v.assign(t)
        value = tf.nest.map_structure(tf.identity, original(self))
        with tf.control_dependencies(tf.nest.flatten(value)):
            for v, t in zip(variables, local):
                v.assign(t)
        return value

    return result


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
