"""``horovod.tensorflow.keras`` on MaTEx: ``import matex.horovod.tensorflow.keras as hvd``.

Horovod's Keras API on Keras 3: the process functions, ``DistributedOptimizer``,
``allreduce``/``allgather``/``broadcast`` of values, ``load_model`` and
``callbacks`` (see ``matex.horovod``). Reduce ops: ``Average``, ``Sum``,
``Adasum``, ``Min``, ``Max``, ``Product``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from matex.horovod import _api
from matex.horovod._wrappers import DistributedOptimizer, PartialDistributedOptimizer
from matex.horovod._api import (Adasum,
                                Average, Max, Min, Product, Sum,
                                broadcast_global_variables, ccl_built, cross_rank, cross_size,
                                cuda_built, ddl_built, gloo_built, gloo_enabled, init,
                                is_homogeneous, is_initialized, local_rank, local_size,
                                mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                rocm_built, shutdown, size)
from matex.horovod._compression import Compression, Compressor
from matex.horovod.tensorflow.keras import callbacks
from matex.horovod._api import (ProcessSet, add_process_set, global_process_set,  # process sets
                                remove_process_set)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "allreduce",
    "allgather", "broadcast",
    "broadcast_global_variables", "load_model", "callbacks",
]


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: int | None = None,
              compression: type[Compressor] = Compression.none) -> tf.Tensor:
    """``value`` (a tensor or array) reduced over ranks; default op Average."""
    return _api.allreduce(tf.constant(value) if not tf.is_tensor(value) else value,
                          average=average, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, compression=compression,
                          name=name)


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """Every rank's ``value`` concatenated along axis 0, in rank order."""
    return _api.allgather(tf.constant(value) if not tf.is_tensor(value) else value, name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """Rank ``root_rank``'s ``value`` on every rank."""
    return _api.broadcast(tf.constant(value) if not tf.is_tensor(value) else value, root_rank,
                          name=name)


def load_model(filepath: str, custom_optimizers: list | None = None,
               custom_objects: dict | None = None,
               compression: type[Compressor] = Compression.none) -> Any:
    """``keras.models.load_model`` whose optimizer comes back distributed.

    With ``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is tf-keras) the model is
    loaded by tf-keras, and its optimizer is made distributed in place (its
    restored state kept).
    """
    from matex.horovod import _training
    from matex.legacy import _keras2

    if _keras2.legacy_keras_active():
        from matex.compression import _spec

        return _keras2.load_model(filepath, custom_optimizers, custom_objects, "average",
                                  _spec.from_spec(_training.compression_spec(compression)))
    import keras

    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model

# elastic training (hvd.elastic.run, hvd.elastic.KerasState...)
from matex.horovod.tensorflow.keras import elastic  # noqa: E402

__all__ += ["elastic"]


__all__ += ["ProcessSet", "global_process_set", "add_process_set",   # process sets
            "remove_process_set"]
