"""Adaptive neuron apoptosis: units whose activity stays low die during training.

After PNNL MaTEx's adaptive neuron apoptosis (Siegel et al.): a Dense unit or
a convolution channel whose activity stays low for a while is removed; the
network keeps training without it and ends up smaller.

How it works here (chosen for cost, and to keep ranks identical):

- Activity is measured on a *probe set* (``data``: a few hundred of this
  rank's samples) through one sub-model over the watched layers' outputs,
  every ``interval`` epochs after ``warmup`` epochs: one forward pass over
  the probe, no per-batch hooks in the training step. A unit's activity is
  its mean |activation| over the probe samples (and spatial positions for
  convolutions), summed over ranks with one allreduce, divided by the mean
  activity of the layer's live units: ``threshold`` is relative, in [0, 1).
- A unit whose relative activity stays below ``threshold`` for ``patience``
  consecutive checks dies (lowest activity first, at most ``max_fraction`` of
  a layer's units in total, at least ``min_units`` left). Rank 0's decision
  is broadcast, so every rank kills the same units.
- A dead unit's kernel column and bias are multiplied by a 0/1 mask
  variable: once when it dies and after every optimizer update, through the
  variables' ``constraint`` (Keras applies constraints after each update, in
  the compiled step), so it stays dead whatever the optimizer's momentum.
- ``shrink()`` / ``shrink_model(model, masks)`` builds a new, smaller model
  with the same outputs: dead columns of layer L and the matching input rows
  (channels) of the next weighted layer are removed; a dead unit's constant
  output ``activation(0)`` is folded into the next layer's bias.

Supported by ``shrink_model``: Sequential models and functional models that
are one chain (one input, one output, each layer feeding the next) of Dense,
Conv1D/2D/3D (``groups=1``) and, between them, Flatten, Dropout-like,
pooling (max/average, global), Activation/ReLU/LeakyReLU/ELU layers.
Not supported (ValueError naming the layer): BatchNormalization and other
normalisations after a pruned layer, residual/branching graphs, depthwise,
separable and transposed convolutions, RNNs, ``channels_first`` layouts, and
a non-zero ``activation(0)`` feeding a ``padding="same"`` convolution.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from matex import _collectives, _runtime


def _say(message: str) -> None:
    if _runtime.rank() == 0:
        print(message, flush=True)

_WEIGHTED = (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_UNWEIGHTED_CONV = (keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D,
                    keras.layers.Conv2DTranspose)
_PASS_PER_CHANNEL = (keras.layers.Dropout, keras.layers.SpatialDropout1D,
                     keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D,
                     keras.layers.GaussianNoise, keras.layers.GaussianDropout,
                     keras.layers.MaxPooling1D, keras.layers.MaxPooling2D,
                     keras.layers.MaxPooling3D, keras.layers.AveragePooling1D,
                     keras.layers.AveragePooling2D, keras.layers.AveragePooling3D,
                     keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D,
                     keras.layers.GlobalMaxPooling3D, keras.layers.GlobalAveragePooling1D,
                     keras.layers.GlobalAveragePooling2D, keras.layers.GlobalAveragePooling3D)
_ELEMENTWISE = (keras.layers.Activation, keras.layers.ReLU, keras.layers.LeakyReLU,
                keras.layers.ELU)


def _units(layer) -> int:
    return int(layer.units if isinstance(layer, keras.layers.Dense) else layer.filters)


def _is_weighted(layer) -> bool:
    return isinstance(layer, _WEIGHTED) and not isinstance(layer, _UNWEIGHTED_CONV)


def _chain(model) -> list:
    """The model's layers as one chain (InputLayer left out), or ValueError."""
    layers = [lay for lay in model.layers if not isinstance(lay, keras.layers.InputLayer)]
    if isinstance(model, keras.Sequential):
        return layers
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError("shrink_model supports one-input, one-output chains; %r has %d inputs "
                         "and %d outputs" % (model.name, len(model.inputs), len(model.outputs)))
    previous = model.inputs[0]
    for lay in layers:
        try:
            source = lay.input
        except (AttributeError, ValueError) as exc:
            raise ValueError("shrink_model: layer %r is used more than once or not in a chain "
                             "(%s)" % (lay.name, exc)) from None
        if source is not previous:
            raise ValueError("shrink_model supports chains only: layer %r does not take the "
                             "previous layer's output" % lay.name)
        previous = lay.output
    if previous is not model.outputs[0]:
        raise ValueError("shrink_model: the last layer's output is not the model's output")
    return layers


def _activation_of(layer, values: np.ndarray) -> np.ndarray:
    """An elementwise layer (or a weighted layer's activation) applied to ``values``."""
    if _is_weighted(layer):
        fn = keras.activations.get(layer.activation)
        return np.asarray(keras.ops.convert_to_numpy(fn(tf.constant(values, tf.float32))))
    return np.asarray(keras.ops.convert_to_numpy(layer(tf.constant(values[None], tf.float32))))[0]


def _check_supported(layer):
    if _is_weighted(layer):
        if getattr(layer, "groups", 1) != 1:
            raise ValueError("shrink_model: grouped convolution %r is not supported" % layer.name)
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            raise ValueError("shrink_model: %r is channels_first (not supported)" % layer.name)
        return
    if isinstance(layer, _PASS_PER_CHANNEL + _ELEMENTWISE + (keras.layers.Flatten,)):
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            raise ValueError("shrink_model: %r is channels_first (not supported)" % layer.name)
        return
    raise ValueError("shrink_model: layer %r (%s) is not supported between pruned layers; "
                     "supported: Dense, Conv1D/2D/3D, Flatten, dropout, pooling, activations"
                     % (layer.name, type(layer).__name__))


def _plan(model, masks: dict) -> tuple:
    """Walk the chain: per layer, (layer, keep_in, keep_out, bias_extra); and the parameter count.

    ``keep_in`` selects input features (rows / input channels) of a weighted
    layer, ``keep_out`` its output units; ``bias_extra`` is the contribution
    of removed inputs (their constant value times their weights).
    """
    layers = _chain(model)
    weighted = [lay for lay in layers if _is_weighted(lay)]
    unknown = set(masks) - {lay.name for lay in weighted}
    if unknown:
        raise ValueError("masks name layers that are not Dense/Conv layers of the model: %s"
                         % sorted(unknown))
    if weighted and weighted[-1].name in masks and not np.all(masks[weighted[-1].name]):
        raise ValueError("the output layer %r cannot lose units" % weighted[-1].name)
    keep = None       # boolean over the current tensor's last axis (None: all kept)
    const = None      # value of removed features (float array, same length)
    steps, params = [], 0
    for lay in layers:
        _check_supported(lay)
        if _is_weighted(lay):
            kernel = keras.ops.convert_to_numpy(lay.kernel)
            n_in = kernel.shape[-2]
            keep_in = np.ones(n_in, bool) if keep is None else keep
            if len(keep_in) != n_in:
                raise ValueError("shrink_model: %r expects %d inputs, the chain gives %d"
                                 % (lay.name, n_in, len(keep_in)))
            extra = np.zeros(kernel.shape[-1], np.float64)
            if const is not None and np.any(const[~keep_in] != 0):
                if kernel.ndim > 2 and lay.padding != "valid":
                    raise ValueError(
                        "shrink_model: removed units before %r output a non-zero constant "
                        "(activation(0) != 0) and %r pads (padding=%r): not exact; use "
                        "padding='valid' or an activation with activation(0) == 0"
                        % (lay.name, lay.name, lay.padding))
                removed = ~keep_in
                summed = kernel.reshape(-1, n_in, kernel.shape[-1]).sum(axis=0)
                extra = (const[removed, None] * summed[removed]).sum(axis=0)
            mask = masks.get(lay.name)
            keep_out = (np.ones(kernel.shape[-1], bool) if mask is None
                        else np.asarray(mask, bool).reshape(-1))
            if len(keep_out) != kernel.shape[-1]:
                raise ValueError("mask of %r has %d entries, the layer has %d units"
                                 % (lay.name, len(keep_out), kernel.shape[-1]))
            if not keep_out.any():
                raise ValueError("mask of %r removes every unit" % lay.name)
            spatial = int(np.prod(kernel.shape[:-2], dtype=np.int64))
            params += spatial * int(keep_in.sum()) * int(keep_out.sum())
            if lay.use_bias:
                params += int(keep_out.sum())
            steps.append((lay, keep_in, keep_out, extra))
            keep = keep_out
            const = _activation_of(lay, np.zeros(len(keep_out), np.float32)).astype(np.float64)
        elif isinstance(lay, keras.layers.Flatten):
            if keep is not None:
                inner = lay.input.shape[1:] if hasattr(lay, "input") else None
                positions = int(np.prod(inner[:-1])) if inner else 1
                keep, const = np.tile(keep, positions), np.tile(const, positions)
            steps.append((lay, None, None, None))
        elif isinstance(lay, _ELEMENTWISE):
            if const is not None:
                const = _activation_of(lay, const.astype(np.float32)).astype(np.float64)
            steps.append((lay, None, None, None))
        else:
            steps.append((lay, None, None, None))   # per-channel: a constant stays constant
    return steps, params


def count_shrunk_params(model: keras.Model, masks: dict) -> int:
    """Parameters the model would have after ``shrink_model(model, masks)`` (no model built)."""
    return _plan(model, masks)[1]


def shrink_model(model: keras.Model, masks: dict) -> keras.Model:
    """A new, smaller model with the outputs of ``model`` with the ``masks``' dead units.

    ``masks`` maps layer names to 0/1 (or boolean) arrays over the layer's
    units; 0 = dead. Dead units' kernel columns and biases must be zero in
    ``model`` (as ``NeuronApoptosis`` leaves them) for the outputs to agree.
    Returns a ``keras.Sequential`` (uncompiled).
    """
    steps, _ = _plan(model, {k: np.asarray(v) > 0.5 for k, v in masks.items()})
    new_layers, weights = [], []
    for lay, keep_in, keep_out, extra in steps:
        config = lay.get_config()
        if keep_out is None:
            new_layers.append(type(lay).from_config(config))
            weights.append(None)
            continue
        key = "units" if isinstance(lay, keras.layers.Dense) else "filters"
        config[key] = int(keep_out.sum())
        new_layers.append(type(lay).from_config(config))
        kernel = keras.ops.convert_to_numpy(lay.kernel)
        kernel = kernel[..., keep_in, :][..., keep_out]
        values = [kernel]
        if lay.use_bias:
            bias = keras.ops.convert_to_numpy(lay.bias).astype(np.float64) + extra
            values.append(bias[keep_out].astype(kernel.dtype))
        weights.append(values)
    shape = tuple(model.inputs[0].shape[1:])
    shrunk = keras.Sequential([keras.Input(shape)] + new_layers, name=model.name + "_shrunk")
    for lay, values in zip(new_layers, weights):
        if values is not None:
            lay.set_weights(values)
    return shrunk


class _MaskConstraint:
    """Keeps dead units at zero after each optimizer update (composes with an existing one)."""

    def __init__(self, mask, previous=None):
        self.mask, self.previous = mask, previous

    def __call__(self, w):
        if self.previous is not None:
            w = self.previous(w)
        return w * tf.cast(self.mask, w.dtype)


class NeuronApoptosis(keras.callbacks.Callback):
    """Keras callback: units whose activity stays low die (masked now, removable by ``shrink``).

    Args:
      data: probe samples of THIS rank (an array or tuple of arrays the
        model takes as input; a few hundred suffice). Activity is measured on
        them, summed over ranks.
      threshold: relative activity in [0, 1): a unit is quiet when its mean
        |activation| is below ``threshold`` x the mean of the layer's live units.
      patience: consecutive quiet checks (>= 1) before a unit dies.
      layers: names of the Dense/Conv layers to watch; None = every Dense/Conv
        layer but the last (the output).
      warmup: epochs (>= 0) before the first check.
      interval: check every ``interval`` epochs (>= 1).
      max_fraction: at most this fraction (0, 1] of a layer's units dies in total.
      min_units: at least this many units (>= 1) stay alive in each layer.
      batch_size: batch of the probe forward pass.
      verbose: log each death on rank 0.

    Attributes: ``masks`` (layer name -> float 0/1 array), ``params_before``
    (the model's parameter count), ``params_after`` (the count once dead
    units are removed, = ``shrink().count_params()``), ``history`` (one dict
    per check: epoch, dead units per layer, params_after).
    """

    def __init__(self, data: Any, threshold: float = 0.1, patience: int = 2,
                 layers: Sequence[str] | None = None,
                 warmup: int = 1, interval: int = 1, max_fraction: float = 0.5,
                 min_units: int = 1, batch_size: int = 512, verbose: bool = True) -> None:
        super().__init__()
        if not (isinstance(threshold, (int, float)) and 0.0 <= threshold < 1.0):
            raise ValueError("NeuronApoptosis: threshold is a relative activity in [0, 1), "
                             "got %r" % (threshold,))
        if int(patience) != patience or patience < 1:
            raise ValueError("NeuronApoptosis: patience must be an integer >= 1, got %r"
                             % (patience,))
        if int(warmup) != warmup or warmup < 0:
            raise ValueError("NeuronApoptosis: warmup must be an integer >= 0, got %r" % (warmup,))
        if int(interval) != interval or interval < 1:
            raise ValueError("NeuronApoptosis: interval must be an integer >= 1, got %r"
                             % (interval,))
        if not 0.0 < max_fraction <= 1.0:
            raise ValueError("NeuronApoptosis: max_fraction must be in (0, 1], got %r"
                             % (max_fraction,))
        if int(min_units) != min_units or min_units < 1:
            raise ValueError("NeuronApoptosis: min_units must be an integer >= 1, got %r"
                             % (min_units,))
        if data is None:
            raise ValueError("NeuronApoptosis: data (probe samples of this rank) is required")
        self.data = data
        self.threshold, self.patience = float(threshold), int(patience)
        self.layer_names = list(layers) if layers is not None else None
        self.warmup, self.interval = int(warmup), int(interval)
        self.max_fraction, self.min_units = float(max_fraction), int(min_units)
        self.batch_size, self.verbose = int(batch_size), bool(verbose)
        self.masks, self.history = {}, []
        self.params_before = self.params_after = None
        self._variables, self._quiet, self._probe, self._layers = {}, {}, None, []

    # -- set-up ----------------------------------------------------------------

    def _watched(self, model) -> list:
        weighted = [lay for lay in model.layers if _is_weighted(lay)]
        if self.layer_names is None:
            return weighted[:-1]
        by_name = {lay.name: lay for lay in weighted}
        missing = [n for n in self.layer_names if n not in by_name]
        if missing:
            raise ValueError("NeuronApoptosis: layers %s are not Dense/Conv layers of the model "
                             "(those are %s)" % (missing, sorted(by_name)))
        if weighted and weighted[-1].name in self.layer_names:
            raise ValueError("NeuronApoptosis: the output layer %r cannot lose units"
                             % weighted[-1].name)
        return [by_name[n] for n in self.layer_names]

    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        if not self._layers:
            self._layers = self._watched(model)
            for lay in self._layers:
                n = _units(lay)
                self.masks[lay.name] = np.ones(n, np.float32)
                mask = tf.Variable(np.ones(n, np.float32), trainable=False,
                                   name="apoptosis_mask_" + lay.name)
                self._variables[lay.name] = mask
                self._quiet[lay.name] = np.zeros(n, np.int64)
                lay.kernel.constraint = _MaskConstraint(mask, lay.kernel.constraint)
                if lay.use_bias:
                    lay.bias.constraint = _MaskConstraint(mask, lay.bias.constraint)
            self._probe = keras.Model(model.inputs, [lay.output for lay in self._layers])
            self.params_before = int(model.count_params())
            self.params_after = self.params_before
            # the step applies constraints as traced: rebuild it so it sees the masks
            model.make_train_function(force=True)

    # -- checks ------------------------------------------------------------------

    def _activity(self) -> list:
        """Per watched layer, mean |activation| per unit over every rank's probe samples."""
        # called directly, batch by batch: this rank's probe only (predict under
        # matex.keras would shard and gather it across ranks)
        data = self.data
        n = len(data[0] if isinstance(data, (tuple, list)) else data)
        sums = [np.zeros(_units(lay)) for lay in self._layers]
        counts = [0.0] * len(self._layers)
        for start in range(0, n, self.batch_size):
            part = (type(data)(d[start:start + self.batch_size] for d in data)
                    if isinstance(data, (tuple, list)) else data[start:start + self.batch_size])
            outputs = self._probe(part, training=False)
            if len(self._layers) == 1:
                outputs = [outputs]
            for i, out in enumerate(outputs):
                out = np.abs(np.asarray(out, np.float64))
                sums[i] += out.reshape(-1, out.shape[-1]).sum(axis=0)
                counts[i] += out.size // out.shape[-1]
        flat = np.concatenate(sums + [np.asarray(counts, np.float64)])
        total = np.asarray(_collectives.allreduce(tf.constant(flat), "sum"))
        result, start = [], 0
        for i, s in enumerate(sums):
            count = total[len(flat) - len(counts) + i]
            result.append(total[start:start + len(s)] / max(count, 1.0))
            start += len(s)
        return result

    def _decide(self, activity: list) -> dict:
        """New deaths per layer (rank 0's decision; the caller broadcasts it)."""
        deaths = {}
        for lay, act in zip(self._layers, activity):
            name, mask = lay.name, self.masks[lay.name]
            alive = mask > 0.5
            mean = act[alive].mean() if alive.any() else 0.0
            relative = act / mean if mean > 0 else np.zeros_like(act)
            quiet = alive & (relative < self.threshold)
            self._quiet[name] = np.where(quiet, self._quiet[name] + 1, 0)
            candidates = np.flatnonzero(quiet & (self._quiet[name] >= self.patience))
            n = len(mask)
            allowed = min(int(np.floor(self.max_fraction * n)) - int((~alive).sum()),
                          int(alive.sum()) - self.min_units)
            if allowed <= 0 or not len(candidates):
                continue
            candidates = candidates[np.argsort(relative[candidates], kind="stable")][:allowed]
            deaths[name] = sorted(int(i) for i in candidates)
        return deaths

    def check(self, epoch: int = -1) -> dict:
        """Measure activity now and kill the units due (collective: call on every rank)."""
        activity = self._activity()
        deaths = self._decide(activity) if _runtime.rank() == 0 else None
        deaths = _runtime.control().bcast(deaths, root=0)
        if _runtime.rank() != 0:     # keep the quiet counters identical too
            self._decide(activity)
        for lay in self._layers:
            for i in deaths.get(lay.name, ()):
                self.masks[lay.name][i] = 0.0
                self._quiet[lay.name][i] = 0
            if lay.name in deaths:
                mask = self.masks[lay.name]
                self._variables[lay.name].assign(mask)
                lay.kernel.assign(keras.ops.convert_to_numpy(lay.kernel) * mask)
                if lay.use_bias:
                    lay.bias.assign(keras.ops.convert_to_numpy(lay.bias) * mask)
        self.params_after = count_shrunk_params(self.model, self.bool_masks())
        entry = {"epoch": int(epoch), "params_after": self.params_after,
                 "dead": {name: int((m < 0.5).sum()) for name, m in self.masks.items()}}
        self.history.append(entry)
        if deaths and self.verbose:
            _say("apoptosis: epoch %d: %s dead; parameters %d -> %d once removed"
                 % (epoch + 1, ", ".join("%s %d/%d" % (n, entry["dead"][n], len(m))
                                         for n, m in self.masks.items()),
                    self.params_before, self.params_after))
        return deaths

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch + 1 > self.warmup and (epoch + 1 - self.warmup) % self.interval == 0:
            self.check(epoch)
        if logs is not None and self.params_after is not None:
            logs["apoptosis_params"] = float(self.params_after)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.verbose and self.params_before is not None:
            _say("apoptosis: parameters %d before, %d after removing dead units (%.2fx smaller)"
                 % (self.params_before, self.params_after,
                    self.params_before / max(self.params_after, 1)))

    # -- results -------------------------------------------------------------------

    def bool_masks(self) -> dict:
        """Layer name -> boolean array, True = alive."""
        return {name: m > 0.5 for name, m in self.masks.items()}

    def shrink(self, model: keras.Model | None = None) -> keras.Model:
        """The physically smaller model (same outputs as the masked one)."""
        return shrink_model(model if model is not None else self.model, self.bool_masks())
