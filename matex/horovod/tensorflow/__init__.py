"""``horovod.tensorflow`` on MaTEx: ``import matex.horovod.tensorflow as hvd``.

Horovod's names with Horovod's semantics (see ``matex.horovod``), Horovod's
later collectives included (alltoall, reducescatter, barrier, the object
collectives, grouped allgather/reducescatter).

Reduce ops (Horovod's integers): ``Average``, ``Sum``, ``Adasum``, ``Min``,
``Max``, ``Product``. ``util`` is ``horovod.tensorflow.util``.
"""

from matex.horovod._wrappers import (DistributedGradientTape, DistributedOptimizer,
                                     PartialDistributedGradientTape, PartialDistributedOptimizer)
from matex.horovod._api import (Adasum,
                                Average, Max, Min, Product, Sum, allgather, allgather_object,
                                alltoall, barrier, broadcast_object, broadcast_object_fn,
                                grouped_allgather, grouped_reducescatter, reducescatter,
                                allreduce,
                                broadcast, broadcast_, broadcast_global_variables,
                                broadcast_variables, ccl_built, cross_rank, cross_size,
                                cuda_built, ddl_built, gloo_built, gloo_enabled,
                                grouped_allreduce, handle_average_backwards_compatibility, init,
                                is_homogeneous, is_initialized, join, local_rank, local_rank_op,
                                local_size, local_size_op, mpi_built, mpi_enabled,
                                mpi_threads_supported, nccl_built, rank, rank_op, rocm_built,
                                shutdown, size, size_op)
from matex.horovod._api import _executing_eagerly  # noqa: F401 - Horovod's tests use hvd._executing_eagerly
from matex.horovod._compression import Compression
from matex.horovod._sync_bn import SyncBatchNormalization
from matex.horovod.common.util import gpu_available
from matex.horovod.tensorflow import util
from matex.horovod._api import (ProcessSet, add_process_set, global_process_set,  # process sets
                                process_set_included_op, remove_process_set)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "rank_op", "size_op", "local_rank_op",
    "local_size_op", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "handle_average_backwards_compatibility",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_",
    "broadcast_variables", "broadcast_global_variables", "Compression",
    "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedOptimizer",
    "PartialDistributedGradientTape", "SyncBatchNormalization", "gpu_available", "join",
    "util", "barrier", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "grouped_allgather", "reducescatter", "grouped_reducescatter", "alltoall",
]

# elastic training (hvd.elastic.run, hvd.elastic.KerasState...)
from matex.horovod.tensorflow import elastic  # noqa: E402

__all__ += ["elastic"]
__all__ += ["ProcessSet", "global_process_set", "add_process_set",   # process sets
            "remove_process_set", "process_set_included_op"]
from matex.legacy._optimizer_v1 import BroadcastGlobalVariablesHook  # noqa: E402 - TF1 Sessions

__all__ += ["BroadcastGlobalVariablesHook"]
from matex.horovod.tensorflow import mpi_ops  # noqa: E402,F401 - hvd.mpi_ops._basics (Horovod's tests)
