"""``horovod.keras`` on MaTEx: the same API as ``matex.horovod.tensorflow.keras`` (Keras 3)."""

from matex.horovod.tensorflow.keras import (DistributedOptimizer,
                                            PartialDistributedOptimizer, Adasum, Average,
                                            Compression,
                                            Max, Min, Product, Sum, allgather, allreduce,
                                            broadcast, broadcast_global_variables, ccl_built,
                                            cross_rank, cross_size, cuda_built, ddl_built,
                                            gloo_built, gloo_enabled, init, is_homogeneous,
                                            is_initialized, load_model, local_rank, local_size,
                                            mpi_built, mpi_enabled, mpi_threads_supported,
                                            nccl_built, rank, rocm_built, shutdown, size)
from matex.horovod.keras import callbacks

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "allreduce",
    "allgather", "broadcast",
    "broadcast_global_variables", "load_model", "callbacks",
]

# elastic training (hvd.elastic.run, hvd.elastic.KerasState...)
from matex.horovod.keras import elastic  # noqa: E402

__all__ += ["elastic"]
