"""Horovod's training wrappers: ``DistributedOptimizer``, ``DistributedGradientTape``
and their ``Partial`` variants, with Horovod's signatures and semantics.

Each checks Horovod's arguments, then makes the optimizer for its kind: a
Keras 3 optimizer (``matex.DistributedOptimizer`` reducing through a
``HorovodReduction``), a Keras 2 one (``matex.legacy._keras2``) or a TF1
``tf.compat.v1.train.Optimizer`` (``matex.legacy._optimizer_v1``). Explicit,
as Horovod's: a wrapper reduces what it is given, over its process set, and
broadcasts nothing unasked.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from matex import _optimizer, _recovery, _transparent
from matex.compression import _spec
from matex.horovod import _training
from matex.horovod._api import Average
from matex.horovod._compression import Compression, Compressor
from matex.legacy import _keras2, _optimizer_v1

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "DistributedGradientTape",
           "PartialDistributedGradientTape"]


def _local_layers(local_layers: Any) -> list:
    """Horovod's ``local_layers=``: None, one Keras layer or an iterable of them."""
    import keras

    def is_layer(layer):   # a Keras 3 layer, or a Keras 2 (tf-keras) one
        return isinstance(layer, keras.layers.Layer) or (_keras2.is_keras2(layer)
                                                         and hasattr(layer, "trainable_weights"))

    if local_layers is None:
        return []
    if is_layer(local_layers):
        return [local_layers]
    local_layers = list(local_layers)
    if not all(is_layer(layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return local_layers


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True) -> Any:
    """A Keras 3 optimizer whose gradients are averaged (or summed) over ranks.

    ``matex.DistributedOptimizer`` under Horovod's signature: ``op`` Average,
    Sum or Adasum, ``compression`` none or fp16. ``gradient_predivide_factor``
    only splits Horovod's average into a pre- and post-division: the average
    is the same, and MaTEx divides once. ``backward_passes_per_step=N``
    accumulates gradients locally and reduces and applies them every N-th
    call (divided by N with ``average_aggregated_gradients``); the other calls
    only advance ``iterations``, as in Horovod. ``sparse_as_dense`` makes
    ``IndexedSlices`` gradients dense before the reduction. The optimizer
    gains Horovod's ``register_local_var(var)``: that variable's gradient is
    not reduced (divided by the number of ranks with
    ``scale_local_gradients``). ``process_set``: the gradients are reduced
    over its members only (the others keep theirs). A TF1
    ``tf.compat.v1.train.Optimizer`` gives Horovod's TF1 optimizer
    (``matex.legacy._optimizer_v1``): ``compute_gradients`` reduces (with
    ``backward_passes_per_step=N`` it accumulates in local variables and reduces
    every N-th call, in a control flow v2 cond: fetch no other MaTEx collective in
    that ``Session.run``).
    """
    return _distributed_optimizer(optimizer, compression, sparse_as_dense,
                                  backward_passes_per_step, op, gradient_predivide_factor,
                                  average_aggregated_gradients, num_groups, groups, process_set,
                                  scale_local_gradients, None, "DistributedOptimizer")


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                use_locking: bool = False, device_dense: str = "",
                                device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False,
                                backward_passes_per_step: int = 1, op: int = Average,
                                gradient_predivide_factor: float = 1.0,
                                average_aggregated_gradients: bool = False,
                                num_groups: int = 0, groups: Any = None,
                                process_set: Any = None, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """``DistributedOptimizer`` whose ``local_layers``' gradients are not reduced.

    Those layers' trainable weights are updated from this rank's gradients
    only (divided by the number of ranks with ``scale_local_gradients``, as
    Horovod does), so they may differ between ranks; every other weight gets
    the reduced gradients.
    """
    return _distributed_optimizer(optimizer, compression, sparse_as_dense,
                                  backward_passes_per_step, op, gradient_predivide_factor,
                                  average_aggregated_gradients, num_groups, groups, process_set,
                                  scale_local_gradients, _local_layers(local_layers),
                                  "PartialDistributedOptimizer")


def _distributed_optimizer(optimizer, compression, sparse_as_dense, backward_passes_per_step,
                           op, gradient_predivide_factor, average_aggregated_gradients,
                           num_groups, groups, process_set, scale_local_gradients, local_layers,
                           what):
    _transparent.explicit_layer_in_use("horovod")
    if _keras2.is_keras2(optimizer):   # Keras 2 (tf-keras): Horovod's Keras 2 optimizer
        return _keras2.horovod_optimizer(
            optimizer, compression, sparse_as_dense, backward_passes_per_step, op,
            gradient_predivide_factor, average_aggregated_gradients, num_groups, groups,
            process_set, scale_local_gradients, local_layers, what)
    _training.check_training_args(what, backward_passes_per_step, gradient_predivide_factor, op,
                                  num_groups, groups, process_set)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):   # TF1 graphs: matex.legacy
        reduction = _training.HorovodReduction(
            _training.training_op(op, what),
            _spec.from_spec(_training.compression_spec(compression)), sparse_as_dense,
            backward_passes_per_step, average_aggregated_gradients, local_layers or (),
            scale_local_gradients)
        return _optimizer_v1.horovod_optimizer(
            optimizer, _training.reduce_within(reduction, process_set), what)
    spec = _training.compression_spec(compression)
    optimizer = _optimizer.DistributedOptimizer(optimizer, op=_training.training_op(op, what),
                                                compression=spec)
    state = optimizer._matex
    if state.strategy is not None and not isinstance(state.strategy, _training.HorovodReduction):
        raise ValueError("%s: this optimizer already synchronises through %r"
                         % (what, state.strategy))
    reduction = _training.HorovodReduction(
        state.op, _spec.from_spec(spec), sparse_as_dense, backward_passes_per_step,
        average_aggregated_gradients, local_layers or (), scale_local_gradients,
        state.threshold)
    state.strategy = _training.reduce_within(reduction, process_set)
    object.__setattr__(optimizer, "register_local_var", reduction.register_local_var)
    if backward_passes_per_step > 1:   # the counter and accumulators: recovery state
        _recovery.join(optimizer, "accumulation",
                       lambda opt, variables: reduction.recovery_state(opt))
    else:   # wrapped again without accumulation: the earlier reduction's state goes
        _recovery.leave(optimizer, "accumulation")
    # Explicit, as Horovod's: it reduces what it is given, over its set, and broadcasts
    # nothing unasked (no first-step broadcast of rank 0's weights over every rank, which
    # hung a set training alone and overwrote local layers): the script broadcasts
    # (BroadcastGlobalVariablesCallback, hvd.broadcast_variables).
    _recovery.mark_first_step_synced(optimizer)
    return optimizer


def _distributed_tape(gradtape, compression, sparse_as_dense, op, gradient_predivide_factor,
                      num_groups, groups, process_set, scale_local_gradients, local_layers, what):
    _transparent.explicit_layer_in_use("horovod")
    _training.check_training_args(what, 1, gradient_predivide_factor, op, num_groups, groups,
                                  process_set)
    reduction = _training.HorovodReduction(
        _training.training_op(op, what), _spec.from_spec(_training.compression_spec(compression)),
        sparse_as_dense, local_layers=local_layers, scale_local_gradients=scale_local_gradients)
    return _training.horovod_tape(gradtape, _training.reduce_within(reduction, process_set))


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: Any = None,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """``gradtape`` with gradients averaged (or summed) over ranks.

    Options as ``DistributedOptimizer`` (Horovod's tape has no
    ``backward_passes_per_step``). The tape gains Horovod's
    ``register_local_source(var)`` and ``get_local_and_global_gradients``.
    """
    return _distributed_tape(gradtape, compression, sparse_as_dense, op,
                             gradient_predivide_factor, num_groups, groups, process_set,
                             scale_local_gradients, (), "DistributedGradientTape")


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: Any = None,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """``DistributedGradientTape`` whose ``local_layers``' gradients are not reduced."""
    return _distributed_tape(gradtape, compression, sparse_as_dense, op,
                             gradient_predivide_factor, num_groups, groups, process_set,
                             scale_local_gradients, _local_layers(local_layers),
                             "PartialDistributedGradientTape")
