"""Tensor (horizontal) model parallelism: a layer's weights split over the tensor group.

The ``T`` ranks of a grid's tensor communicator (``grid(tensor=T)``) each
hold 1/T of a layer's weights and all see the same input batch. As in
Megatron-LM, two functions carry the communication:

* ``copy_to_tensor_group`` ("f"): identity forward, allreduce-sum backward.
  A replicated input feeding a split layer: each rank's input gradient covers
  only its own shard, the sum over the group is the full gradient.
* ``reduce_from_tensor_group`` ("g"): allreduce-sum forward, identity
  backward. Partial products of a row-split layer summed into the full
  output; its gradient is already replicated. (The allreduce op's registered
  gradient would sum the replicated gradient again, T times too large: hence
  ``tf.custom_gradient``.)

``ColumnParallelDense`` splits the output features (each rank computes
units/T columns; the output is gathered over the group or kept split for a
following ``RowParallelDense``). ``RowParallelDense`` splits the input
features and sums the partial products. A Column(gather_output=False) +
Row(input_is_parallel=True) pair costs one allreduce forward and one
backward. ``ParallelConv2D`` splits the output channels (channels-last).

Initialisation: each rank holds only its slice, with the values the full
kernel would get: a seeded Keras initializer is a stateless Philox draw, so a
rank draws the full kernel in blocks of rows from the matching counters and
keeps its columns of each (``sliced_initializer``; peak: the slice plus one
block). Put together, the shards equal an unsharded layer's weights.
Every layer's ``supports_jit`` is False (the ops have no XLA kernels).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import keras
import tensorflow as tf

from matex import _compat, _state
from matex._everywhere import RemoteError, on_every_rank
from matex.parallel._streamgather import stream_gather

if TYPE_CHECKING:
    from matex.parallel._grid import Grid

# The layer classes are registered with Keras (package "matex") when this module is
# imported, which ``import matex`` arranges as soon as Keras is loaded
# (``matex.parallel._saving``): so this module imports neither MPI (``_grid``) nor the
# collectives at import time, only where they are used.


def _tensor_group(grid):
    """(slot, size, rank) of the tensor group of ``grid`` (default: the open grid)."""
    from matex.parallel import _grid

    grid = grid if grid is not None else _grid.current()
    if grid is None:
        raise ValueError("tensor-parallel layers need a grid: open one with "
                         "matex.parallel.grid(tensor=T) or pass grid=")
    return grid.tensor_slot, grid.tensor_size, grid.tensor_rank


def copy_to_tensor_group(x, slot: int):
    """Identity forward; the gradient is summed over the tensor group (Megatron's "f")."""
    from matex import _collectives

    @tf.custom_gradient
    def f(x):
        def grad(dy):
            return _collectives.allreduce(dy, op="sum", comm=slot)
        return tf.identity(x), grad
    return f(x)


def reduce_from_tensor_group(x, slot: int):
    """Sum over the tensor group forward; identity backward (Megatron's "g")."""
    from matex import _collectives

    @tf.custom_gradient
    def g(x):
        def grad(dy):
            return tf.identity(dy)
        return _collectives.allreduce(x, op="sum", comm=slot), grad
    return g(x)


def gather_from_tensor_group(x, slot: int, size: int, rank: int):
    """Concatenate the group's shards along the last axis; backward keeps this rank's slice."""
    from matex import _collectives

    @tf.custom_gradient
    def gather(x):
        rank_ = len(x.shape)
        perm = [rank_ - 1] + list(range(rank_ - 1))
        back = list(range(1, rank_)) + [0]
        y = tf.transpose(_collectives.allgather(tf.transpose(x, perm), comm=slot), back)
        last = x.shape[-1]
        y.set_shape(x.shape[:-1].concatenate([None if last is None else last * size]))
        width = tf.shape(x)[-1]

        def grad(dy):
            # The layers after the gather run replicated: dy is the same on
            # every rank, this rank's shard got exactly its slice of it.
            return dy[..., rank * width:(rank + 1) * width]
        return y, grad
    return gather(x)


def _pair(v):
    return (int(v), int(v)) if isinstance(v, int) else tuple(int(a) for a in v)


def _split(n, size, what, layer):
    if n % size:
        raise ValueError("%s: %s = %d is not divisible by the tensor-parallel size %d"
                         % (layer, what, n, size))
    return n // size


# ---- sliced initialisation: this rank's slice of the full draw, drawn block by block ----

# (distribution, dtype) -> (outputs per group, Philox counter steps per group), found once by
# drawing a short sequence whole and again from a shifted counter; None: no such pair
_PHILOX_STEPS: dict = _state.table("parallel.tensor.philox_steps", lifetime="process")
_STATELESS = {"uniform": "StatelessRandomUniformV2", "normal": "StatelessRandomNormalV2",
              "truncated": "StatelessTruncatedNormalV2"}
_BLOCK_ELEMENTS = 1 << 20     # the most elements drawn at once (4 MiB of float32)


def _shift(counter, steps: int):
    """A Philox counter (two uint64: low, high word) advanced by ``steps``."""
    import numpy as np

    low, high = (int(v) for v in counter.numpy())
    value = (low + (high << 64) + steps) % (1 << 128)
    return tf.constant(np.array([value & (2 ** 64 - 1), value >> 64], np.uint64))


def _raw_draw(kind: str, shape, key, counter, alg, dtype):
    return getattr(tf.raw_ops, _STATELESS[kind])(shape=shape, key=key, counter=counter,
                                                 alg=alg, dtype=dtype)


def _philox_steps(kind: str, dtype, key, counter, alg):
    """(group, steps): output ``k * group`` of a draw starts ``k * steps`` counter steps on."""
    import numpy as np

    found = _PHILOX_STEPS.get((kind, dtype.name), False)
    if found is not False:
        return found
    whole = _raw_draw(kind, [4096], key, counter, alg, dtype).numpy()
    found = None
    for group in (1, 2, 4):
        for steps in (1, 2, 4, 64, 128, 256, 512):
            for k in (1, 3):
                part = _raw_draw(kind, [4096 - k * group], key, _shift(counter, k * steps),
                                 alg, dtype).numpy()
                if not np.array_equal(part, whole[k * group:]):
                    break
            else:
                found = (group, steps)
                break
        if found:
            break
    _PHILOX_STEPS[(kind, dtype.name)] = found
    return found


def _fans(shape, input_axes=None, output_axes=None):
    """Keras's fan-in and fan-out of a weight shape (``compute_fans``)."""
    import math

    if input_axes is not None and output_axes is not None:
        return (math.prod(shape[a] for a in input_axes),
                math.prod(shape[a] for a in output_axes))
    if len(shape) < 1:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def _recipe(initializer, full_shape):
    """(distribution, a, b, seed): ``initializer(full_shape)`` is a stateless draw of
    ``distribution`` mapped as Keras/TF do (uniform: ``a + raw * (b - a)``, normals:
    ``raw * b + a``); None for an initializer that is not such a draw (orthogonal,
    identity, a SeedGenerator or unseeded, one of your own)."""
    import math

    ki = keras.initializers
    seed = getattr(initializer, "seed", None)
    if not isinstance(seed, int) or isinstance(seed, bool):
        return None
    kind = type(initializer)
    if isinstance(initializer, ki.VarianceScaling) and kind.__call__ is ki.VarianceScaling.__call__:
        fan_in, fan_out = _fans(full_shape, initializer.input_axes, initializer.output_axes)
        scale = initializer.scale / max(1.0, {"fan_in": fan_in, "fan_out": fan_out}.get(
            initializer.mode, (fan_in + fan_out) / 2.0))
        if initializer.distribution == "truncated_normal":
            return "truncated", 0.0, math.sqrt(scale) / 0.87962566103423978, seed
        if initializer.distribution == "untruncated_normal":
            return "normal", 0.0, math.sqrt(scale), seed
        limit = math.sqrt(3.0 * scale)
        return "uniform", -limit, limit, seed
    if kind is ki.RandomUniform:
        return "uniform", initializer.minval, initializer.maxval, seed
    if kind is ki.RandomNormal:
        return "normal", initializer.mean, initializer.stddev, seed
    if kind is ki.TruncatedNormal:
        return "truncated", initializer.mean, initializer.stddev, seed
    return None


def _shape_free(initializer) -> bool:
    """True for an initializer whose values do not depend on the shape (zeros, a constant)."""
    ki = keras.initializers
    if type(initializer) in (ki.Zeros, ki.Ones):
        return True
    if type(initializer) is ki.Constant:
        import numpy as np
        return np.ndim(initializer.value) == 0
    return False


def _block_draw(initializer, full_shape, dtype):
    """``draw(start, stop)``: elements [start, stop) of ``initializer(full_shape)`` flattened,
    drawn alone from the matching Philox counter; None where that is not possible."""
    recipe = _recipe(initializer, full_shape)
    if recipe is None or not dtype.is_floating:
        return None
    kind, a, b, seed = recipe
    # Keras (TF backend) seeds a stateless draw with [seed mod (2^31 - 2), 0]
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(
        seed=tf.constant([seed % (2 ** 31 - 2), 0], tf.int32))
    alg = tf.raw_ops.StatelessRandomGetAlg()
    steps = _philox_steps(kind, dtype, key, counter, alg)
    if steps is None:
        return None
    group, per_group = steps
    if kind == "uniform":     # Keras: tf.cast(minval, dtype), a Python float via float32
        a_t, b_t = tf.cast(a, dtype), tf.cast(b, dtype)
    else:
        a_t, b_t = tf.constant(a, dtype), tf.constant(b, dtype)

    def draw(start: int, stop: int):
        skip = start % group      # a counter step starts a group: draw from its start
        raw = _raw_draw(kind, [stop - start + skip], key,
                        _shift(counter, (start - skip) // group * per_group), alg, dtype)
        values = (a_t + raw * (b_t - a_t)) if kind == "uniform" else raw * b_t + a_t
        return values[skip:]
    return draw


def _blocks(full_shape, axis: int, rank: int, n: int):
    """(target, start, stop, keep): write ``keep(draw(start, stop))`` to ``target`` (a tuple of
    slices of the rank's slice), block by block; each block at most ~``_BLOCK_ELEMENTS``."""
    import math

    full_shape = tuple(full_shape)
    if axis == 0:       # the slice is one contiguous range of the flat draw: rows of it
        inner = math.prod(full_shape[1:])
        rows = max(1, _BLOCK_ELEMENTS // max(1, inner))
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            yield ((slice(r0, r1),), (rank * n + r0) * inner, (rank * n + r1) * inner,
                   lambda v, r=r1 - r0: tf.reshape(v, (r,) + full_shape[1:]))
        return
    # blocks of whole trailing axes [k, ...): a prefix index over axes < k - 1 and a range
    # of axis k - 1; this rank keeps its part of ``axis`` (k <= axis) of each
    k = next(i for i in range(axis + 1)
             if i == axis or math.prod(full_shape[i:]) <= _BLOCK_ELEMENTS)
    tail = math.prod(full_shape[k:])
    if k == 0:
        prefixes, rows, length = [()], 1, 1
    else:
        prefixes = list(_product(full_shape[:k - 1]))
        length = full_shape[k - 1]
        rows = max(1, _BLOCK_ELEMENTS // tail)
    for prefix in prefixes:
        for r0 in range(0, length, rows):
            r1 = min(r0 + rows, length)
            lead = prefix + ((slice(r0, r1),) if k else ())
            flat = 0
            for i, d in enumerate(full_shape[:k]):
                flat = flat * d + (prefix[i] if i < k - 1 else r0)
            shape = ((r1 - r0,) if k else ()) + full_shape[k:]
            cut = (slice(None),) * (axis - k + (1 if k else 0)) + (slice(rank * n,
                                                                        (rank + 1) * n),)

            def keep(v, shape=shape, cut=cut):
                return tf.reshape(v, shape)[cut]
            yield lead, flat * tail, (flat + (r1 - r0 if k else 1)) * tail, keep


def _write(target, draw, full_shape, axis: int, rank: int, n: int) -> None:
    """Write this rank's slice into the tf.Variable ``target``, one drawn block at a time."""
    shape = [int(d) for d in target.shape]
    for lead, start, stop, keep in _blocks(full_shape, axis, rank, n):
        begin, end = [0] * len(shape), list(shape)
        for i, index in enumerate(lead):
            begin[i], end[i] = ((index.start, index.stop) if isinstance(index, slice)
                                else (index, index + 1))
        part = tf.reshape(keep(draw(start, stop)), [e - b for b, e in zip(begin, end)])
        # the raw op writes in place; ``target[...].assign`` would first read the variable,
        # and the read's alias of its buffer makes the write copy the whole variable
        tf.raw_ops.ResourceStridedSliceAssign(ref=target.handle, begin=begin, end=end,
                                              strides=[1] * len(shape), value=part)


def _product(dims):
    import itertools
    return itertools.product(*(range(d) for d in dims))


def sliced_initializer(initializer, full_shape, axis: int, rank: int, size: int):
    """Initializer: slice ``rank`` of ``size`` along ``axis`` of ``initializer(full_shape)``.

    The values are those of the full draw (Keras's seeded initializers are
    stateless Philox draws: an element depends only on the seed and its place),
    but the full tensor is never held: it is drawn in blocks of at most ~1M
    elements, each from its own Philox counter, and this rank keeps its part
    of each. ``init.write(variable)`` writes the slice in place into a
    ``tf.Variable`` (peak: one block; what the layers' build does); called as an
    initializer, it returns the slice as one tensor. Zeros, ones, a scalar
    constant: made at
    the slice's shape. An initializer that is not a seeded uniform / normal /
    truncated-normal draw (orthogonal, identity, unseeded, a ``SeedGenerator``
    seed, your own) is drawn whole and sliced, as Keras would draw it (its peak
    is the full tensor).
    """
    full_shape = tuple(int(d) for d in full_shape)
    n = full_shape[axis] // size
    begin = [0] * len(full_shape)
    begin[axis] = rank * n

    def _dtype(dtype):
        return tf.as_dtype(keras.backend.standardize_dtype(dtype or keras.backend.floatx()))

    def init(shape, dtype=None):
        dtype = _dtype(dtype)
        if _shape_free(initializer):
            return initializer(shape, dtype=dtype.name)
        draw = _block_draw(initializer, full_shape, dtype)
        if draw is None:
            full = initializer(full_shape, dtype=dtype.name)
            return tf.slice(tf.convert_to_tensor(full), begin, shape)
        # as one tensor (peak: twice the slice); the layers' build writes into the weight
        # itself instead (``_TensorParallel._add_sliced``)
        scratch = tf.Variable(lambda: tf.raw_ops.Empty(shape=shape, dtype=dtype, init=False),
                              trainable=False)
        _write(scratch, draw, full_shape, axis, rank, n)
        return tf.convert_to_tensor(scratch)

    def write(variable) -> bool:
        """Write the slice in place into ``variable`` (a tf.Variable of the slice's shape),
        block by block (peak: one block); False, writing nothing, where that is impossible."""
        if _shape_free(initializer) or not isinstance(variable, tf.Variable):
            return False
        draw = _block_draw(initializer, full_shape, _dtype(variable.dtype))
        if draw is None:
            return False
        _write(variable, draw, full_shape, axis, rank, n)
        return True

    init.write = write
    return init


def _uninitialised(shape, dtype=None):
    """Initializer for a weight that is written in full right after: memory left as is."""
    return tf.raw_ops.Empty(shape=shape, dtype=tf.as_dtype(dtype or keras.backend.floatx()),
                            init=False)


class _TensorParallel(keras.layers.Layer):
    """Shared by the tensor-parallel layers: the group, the sliced initialisation."""

    def __init__(self, grid=None, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False
        self._slot, self.tensor_size, self.tensor_rank = _tensor_group(grid)

    def _sliced(self, initializer, full_shape, axis):
        """An initializer giving this rank's slice of ``initializer(full_shape)`` along ``axis``."""
        return sliced_initializer(initializer, full_shape, axis, self.tensor_rank,
                                  self.tensor_size)

    def _add_sliced(self, name, shape, initializer, full_shape, axis):
        """A weight holding this rank's slice of ``initializer(full_shape)`` along ``axis``.

        Where the slice can be drawn in blocks, the weight is made over an uninitialised
        buffer (TF adopts it, untouched) and each block is written into it in place, so
        the rank never holds more than its slice plus one block.
        """
        init = self._sliced(initializer, full_shape, axis)
        if _shape_free(initializer) or _recipe(initializer, tuple(full_shape)) is None:
            return self.add_weight(name=name, shape=shape, initializer=init)
        weight = self.add_weight(name=name, shape=shape, initializer=_uninitialised)
        # ``value`` is the backing tf.Variable (a tensor under an autocast scope, or None
        # while Keras defers creating it: then the slice is assigned whole)
        if not init.write(weight.value):
            weight.assign(init(shape, weight.dtype))
        return weight

    def parameter_bytes(self) -> int:
        """Bytes of this rank's shard of the layer's weights."""
        return parameter_bytes(self)


class _ParallelDense(_TensorParallel):
    """What the two split Dense layers share: Dense's arguments and their config."""

    def __init__(self, units, activation, use_bias, kernel_initializer, bias_initializer,
                 grid, **kwargs):
        super().__init__(grid=grid, **kwargs)
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(units=self.units, activation=keras.activations.serialize(self.activation),
                      use_bias=self.use_bias,
                      kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                      bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return config


@keras.saving.register_keras_serializable(package="matex")
class ColumnParallelDense(_ParallelDense):
    """Dense layer whose output features are split over the tensor group.

    Each rank holds ``units / T`` columns of the kernel (and bias). The input
    is replicated over the group. ``gather_output=True`` returns the full
    output on every rank (an allgather); False returns this rank's
    ``units / T`` features, for a following ``RowParallelDense``.
    """

    def __init__(self, units: int, activation: str | Callable | None = None,
                 use_bias: bool = True, kernel_initializer: Any = "glorot_uniform",
                 bias_initializer: Any = "zeros", gather_output: bool = True,
                 grid: Grid | None = None, **kwargs: Any) -> None:
        super().__init__(units, activation, use_bias, kernel_initializer, bias_initializer,
                         grid, **kwargs)
        self.local_units = _split(self.units, self.tensor_size, "units", type(self).__name__)
        self.gather_output = gather_output

    def build(self, input_shape: tuple) -> None:
        in_dim = int(input_shape[-1])
        self.kernel = self._add_sliced("kernel", (in_dim, self.local_units),
                                       self.kernel_initializer, (in_dim, self.units), 1)
        self.bias = self._add_sliced("bias", (self.local_units,), self.bias_initializer,
                                     (self.units,), 0) if self.use_bias else None

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        x = copy_to_tensor_group(inputs, self._slot)
        y = tf.matmul(x, self.kernel) if len(x.shape) == 2 else tf.tensordot(
            x, self.kernel, axes=1)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        if self.gather_output:
            y = gather_from_tensor_group(y, self._slot, self.tensor_size, self.tensor_rank)
        return y

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape[:-1]) + (
            self.units if self.gather_output else self.local_units,)

    def get_config(self) -> dict:
        return dict(super().get_config(), gather_output=self.gather_output)


@keras.saving.register_keras_serializable(package="matex")
class RowParallelDense(_ParallelDense):
    """Dense layer whose input features are split over the tensor group.

    Each rank holds ``in_features / T`` rows of the kernel and computes a
    partial product; one allreduce-sum over the group gives the full output
    on every rank (the bias, replicated, is added after it).
    ``input_is_parallel=True`` expects this rank's slice of the features (a
    ``ColumnParallelDense(gather_output=False)`` output); False takes the full
    input and slices it.
    """

    def __init__(self, units: int, activation: str | Callable | None = None,
                 use_bias: bool = True, kernel_initializer: Any = "glorot_uniform",
                 bias_initializer: Any = "zeros", input_is_parallel: bool = True,
                 grid: Grid | None = None, **kwargs: Any) -> None:
        super().__init__(units, activation, use_bias, kernel_initializer, bias_initializer,
                         grid, **kwargs)
        self.input_is_parallel = input_is_parallel

    def build(self, input_shape: tuple) -> None:
        local = int(input_shape[-1])
        if self.input_is_parallel:
            in_dim = local * self.tensor_size
        else:
            in_dim = local
            local = _split(in_dim, self.tensor_size, "the input features", type(self).__name__)
        self.local_in = local
        self.kernel = self._add_sliced("kernel", (local, self.units), self.kernel_initializer,
                                       (in_dim, self.units), 0)
        self.bias = self.add_weight(name="bias", shape=(self.units,),
                                    initializer=self.bias_initializer) if self.use_bias else None

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        x = inputs
        if not self.input_is_parallel:
            x = copy_to_tensor_group(x, self._slot)
            x = x[..., self.tensor_rank * self.local_in:(self.tensor_rank + 1) * self.local_in]
        y = tf.matmul(x, self.kernel) if len(x.shape) == 2 else tf.tensordot(
            x, self.kernel, axes=1)
        y = reduce_from_tensor_group(y, self._slot)
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self) -> dict:
        return dict(super().get_config(), input_is_parallel=self.input_is_parallel)


@keras.saving.register_keras_serializable(package="matex")
class ParallelConv2D(_TensorParallel):
    """Conv2D (channels-last) whose output channels are split over the tensor group.

    Each rank holds ``filters / T`` filters. ``gather_output=True`` returns all
    channels on every rank (an allgather along channels); False returns this
    rank's ``filters / T`` channels.
    """

    def __init__(self, filters: int, kernel_size: int | tuple[int, int],
                 strides: int | tuple[int, int] = (1, 1), padding: str = "valid",
                 dilation_rate: int | tuple[int, int] = (1, 1),
                 activation: str | Callable | None = None, use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 gather_output: bool = True, grid: Grid | None = None, **kwargs: Any) -> None:
        super().__init__(grid=grid, **kwargs)
        self.filters = int(filters)
        self.local_filters = _split(self.filters, self.tensor_size, "filters",
                                    type(self).__name__)
        self.kernel_size, self.strides = _pair(kernel_size), _pair(strides)
        self.dilation_rate = _pair(dilation_rate)
        self.padding = padding.lower()
        if self.padding not in ("valid", "same"):
            raise ValueError("ParallelConv2D: padding must be 'valid' or 'same', not %r"
                             % padding)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.gather_output = gather_output

    def build(self, input_shape: tuple) -> None:
        cin = int(input_shape[-1])
        full = self.kernel_size + (cin, self.filters)
        self.kernel = self._add_sliced("kernel", self.kernel_size + (cin, self.local_filters),
                                       self.kernel_initializer, full, 3)
        self.bias = self._add_sliced("bias", (self.local_filters,), self.bias_initializer,
                                     (self.filters,), 0) if self.use_bias else None

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        x = copy_to_tensor_group(inputs, self._slot)
        y = tf.nn.conv2d(x, self.kernel, strides=self.strides, padding=self.padding.upper(),
                         dilations=self.dilation_rate)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        if self.gather_output:
            y = gather_from_tensor_group(y, self._slot, self.tensor_size, self.tensor_rank)
        return y

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(filters=self.filters, kernel_size=self.kernel_size, strides=self.strides,
                      padding=self.padding, dilation_rate=self.dilation_rate,
                      activation=keras.activations.serialize(self.activation),
                      use_bias=self.use_bias,
                      kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                      bias_initializer=keras.initializers.serialize(self.bias_initializer),
                      gather_output=self.gather_output)
        return config


def shard_layer(layer: keras.layers.Layer, grid: Grid | None = None, kind: str = "column",
                gather_output: bool = True, input_is_parallel: bool = False) -> keras.layers.Layer:
    """A tensor-parallel copy of a built ``keras.layers.Dense`` or ``Conv2D``.

    ``kind="column"`` splits the output features (Dense) or filters (Conv2D);
    ``kind="row"`` splits a Dense's input features. Each rank's copy holds its
    slice of ``layer``'s current weights. ``gather_output`` and
    ``input_is_parallel`` are passed to the column and row layers.
    """
    if kind not in ("column", "row"):
        raise ValueError("shard_layer: kind must be 'column' or 'row', not %r" % (kind,))
    if not layer.built:
        raise ValueError("shard_layer: %s is not built (call it on an input or build() it "
                         "first, so its weights exist)" % layer.name)
    slot, size, rank = _tensor_group(grid)
    config = layer.get_config()
    common = dict(activation=config["activation"], use_bias=config["use_bias"], grid=grid,
                  name=layer.name + "_tp", dtype=layer.dtype_policy)
    kernel = tf.convert_to_tensor(layer.kernel)
    bias = tf.convert_to_tensor(layer.bias) if config["use_bias"] else None
    if isinstance(layer, keras.layers.Conv2D):
        if kind != "column":
            raise ValueError("shard_layer: a Conv2D can only be split over its output "
                             "channels (kind='column')")
        if config.get("data_format", "channels_last") != "channels_last" or config.get(
                "groups", 1) != 1:
            raise ValueError("shard_layer: only channels_last Conv2D without groups")
        new = ParallelConv2D(config["filters"], config["kernel_size"], config["strides"],
                             config["padding"], config["dilation_rate"],
                             gather_output=gather_output, **common)
        n = new.local_filters
        new.build((None, None, None, int(kernel.shape[2])))
        new.kernel.assign(kernel[..., rank * n:(rank + 1) * n])
        if bias is not None:
            new.bias.assign(bias[rank * n:(rank + 1) * n])
        return new
    if not isinstance(layer, keras.layers.Dense):
        raise TypeError("shard_layer: expected a keras.layers.Dense or Conv2D, got %s"
                        % type(layer).__name__)
    in_dim = int(kernel.shape[0])
    if kind == "column":
        new = ColumnParallelDense(config["units"], gather_output=gather_output, **common)
        n = new.local_units
        new.build((None, in_dim))
        new.kernel.assign(kernel[:, rank * n:(rank + 1) * n])
        if bias is not None:
            new.bias.assign(bias[rank * n:(rank + 1) * n])
        return new
    new = RowParallelDense(config["units"], input_is_parallel=input_is_parallel, **common)
    n = _split(in_dim, size, "the input features", "RowParallelDense")
    new.build((None, n if input_is_parallel else in_dim))
    new.kernel.assign(kernel[rank * n:(rank + 1) * n])
    if bias is not None:
        new.bias.assign(bias)
    return new


def parameter_bytes(model: keras.Model) -> int:
    """Bytes of the weights this rank holds (a tensor-parallel layer: its shard)."""
    return sum(int(tf.size(w)) * tf.as_dtype(w.dtype).size for w in model.weights)


def _plain_config(layer) -> tuple:
    """(class, config) of the ordinary Keras layer a tensor-parallel layer stands for.

    Column/Row-parallel Dense become ``keras.layers.Dense``, ``ParallelConv2D``
    becomes ``keras.layers.Conv2D`` (channels-last), with the full sizes.
    """
    common = dict(name=layer.name, dtype=layer.dtype_policy, trainable=layer.trainable,
                  activation=keras.activations.serialize(layer.activation),
                  use_bias=layer.use_bias,
                  kernel_initializer=keras.initializers.serialize(layer.kernel_initializer),
                  bias_initializer=keras.initializers.serialize(layer.bias_initializer))
    if isinstance(layer, ParallelConv2D):
        return keras.layers.Conv2D, dict(common, filters=layer.filters,
                                         kernel_size=layer.kernel_size, strides=layer.strides,
                                         padding=layer.padding,
                                         dilation_rate=layer.dilation_rate)
    return keras.layers.Dense, dict(common, units=layer.units)


def weight_offers(layer, key) -> list:
    """What this rank can give of ``layer``'s plain-Keras weights, for ``stream_gather``:
    ``(key + (i,), part, parts, axis, value)`` per weight ``i``, where ``value()`` is this
    rank's piece (a shard along ``axis``, ``part`` of ``parts``; or the whole, parts 1)."""
    if not isinstance(layer, _TensorParallel):
        return [(key + (i,), 0, 1, None, (lambda w=w: _numpy(w)))
                for i, w in enumerate(layer.weights)]
    row = isinstance(layer, RowParallelDense)
    t, size = layer.tensor_rank, layer.tensor_size
    offers = [(key + (0,), t, size, 0 if row else len(layer.kernel.shape) - 1,
               lambda: _numpy(layer.kernel))]
    if layer.use_bias:
        offers.append((key + (1,), 0, 1, None, lambda: _numpy(layer.bias)) if row else
                      (key + (1,), t, size, 0, lambda: _numpy(layer.bias)))
    return offers


def _numpy(variable):
    import numpy as np
    return np.asarray(variable)


def gather_model(model: keras.Model, grid: Grid | None = None,
                 root: int = 0) -> keras.Model | None:
    """A plain Keras copy of ``model`` with whole weights, on world rank ``root`` (None elsewhere).

    For a (non-pipelined) model holding ``ColumnParallelDense``,
    ``RowParallelDense`` or ``ParallelConv2D`` layers: each becomes the
    ``Dense`` / ``Conv2D`` it splits, its shards concatenated over the tensor
    group; other layers keep their (replicated) weights. Root builds the plain
    model first, then receives it weight by weight (``stream_gather``): besides
    the model it returns, it holds one weight at a time; the other ranks send
    their shards and hold nothing more. Collective over the grid's ranks
    (default: the open grid); an error on any rank is raised on every rank.
    ``root`` is a rank of the grid's ``world_comm``. For a ``PipelineModel`` use
    its own ``save``.
    """
    grid, clone, offers = _plain_plan(model, grid, "gather_model")
    world = grid.world_comm
    keep = world.Get_rank() == root
    what = "matex.parallel: gathering %s" % model.name

    def skeleton():
        # root builds the plain model (weights still its own initial ones)
        return keras.models.clone_model(model, clone_function=clone) if keep else None

    whole = on_every_rank(world, skeleton, error_type=ValueError, what=what)

    def sink(key, value):
        whole.layers[key[0]].weights[key[1]].assign(value)

    stream_gather(world, root, offers, sink, what)
    return whole


def _plain_plan(model, grid, caller: str):
    """Check ``model`` can be gathered (on every rank); its grid, the layer clone for the
    plain model, and this rank's ``weight_offers`` keyed ``(layer index, weight index)``."""
    from matex.parallel import _grid

    grid = grid if grid is not None else _grid.current()
    if grid is None:
        raise ValueError("%s: no grid: open one with matex.parallel.grid(...) or "
                         "pass grid=" % caller)
    world = grid.world_comm
    what = "matex.parallel: gathering %s" % model.name

    def check():
        layers = [layer for layer in model.layers if isinstance(layer, _TensorParallel)]
        nested = [layer.name for layer in _compat.flatten_layers(model)
                  if isinstance(layer, _TensorParallel) and layer not in layers]
        if nested:
            raise ValueError("tensor-parallel layer(s) %s sit in a nested model; only "
                             "top-level ones are gathered" % ", ".join(nested))
        for layer in layers:
            if not layer.built:
                raise ValueError("gather_model: %s is not built" % layer.name)
            if grid.tensor_comm.Get_size() != layer.tensor_size:
                raise ValueError("gather_model: %s is split %d ways, but the tensor group "
                                 "has %d ranks" % (layer.name, layer.tensor_size,
                                                   grid.tensor_comm.Get_size()))

    on_every_rank(world, check, error_type=ValueError, what=what)

    def clone(layer):
        if isinstance(layer, _TensorParallel):
            cls, config = _plain_config(layer)
            return cls.from_config(config)
        return layer.__class__.from_config(layer.get_config())

    offers = []
    for index, layer in enumerate(model.layers):
        offers.extend(weight_offers(layer, (index,)))
    return grid, clone, offers


def save_model(model: keras.Model, filepath: str | os.PathLike, grid: Grid | None = None,
               root: int = 0, overwrite: bool = True) -> None:
    """Save a model with tensor-parallel layers as one plain Keras file (``root`` writes).

    Collective (see ``gather_model``). The file loads with
    ``keras.models.load_model`` in one process, without MaTEx. The optimizer
    state is not saved. Root never holds the whole model: it builds the plain
    model weightless, writes the file's layout, and writes each weight into it
    as it arrives (``_streamsave``), so its peak is about one weight. Raises
    ``RuntimeError`` (a ``MatexError`` naming the root and its error) on every
    rank if writing failed.
    """
    from matex.parallel import _grid, _streamsave

    if not _streamsave.streamable(filepath):   # a file object, a remote URL: Keras saves it
        whole = gather_model(model, grid, root)
        grid = grid if grid is not None else _grid.current()

        def write():
            if whole is not None:
                whole.save(filepath, overwrite=overwrite)

        on_every_rank(grid.world_comm, write, error_type=RemoteError,
                      what="matex.parallel: saving %s" % (filepath,))
        return
    grid, clone, offers = _plain_plan(model, grid, "save_model")

    def build():
        # clone_model compiles the copy of a compiled model, whose optimizer cannot be
        # made weightless: clone it uncompiled, save_streamed compiles it after
        compiled = model.compiled
        model.compiled = False
        try:
            return keras.models.clone_model(model, clone_function=clone)
        finally:
            model.compiled = compiled

    _streamsave.save_streamed(
        grid.world_comm, root, build, offers,
        lambda whole, key: whole.layers[key[0]].weights[key[1]], filepath, overwrite,
        "matex.parallel: gathering %s" % model.name, compiled_like=model)
