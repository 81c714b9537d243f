"""MaTEx: MPI-backed distributed training for TensorFlow and Keras 3.

    import matex
    matex.init()                      # optional; implicit on first use
    matex.rank(), matex.size()
    matex.allreduce(t, op="average")  # "sum" | "average" | "min" | "max"
    matex.broadcast(t, root=0)
    matex.allgather(t)
    matex.broadcast_variables(model.variables, root=0)
    model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.Adam()), ...)

Run under MPI: ``mpiexec -n 4 python train.py``.
"""

from matex._version import __version__ as __version__  # the one place it is written
from matex import _compat as _compat_module
from matex import _config



def _self_check() -> bool:
    """Whether this process is ``matexrun --check`` / ``python -m matex --check``, which
    reports a missing or old TensorFlow with its fix: the import must not stop it first."""
    import os
    import sys

    flags = ("--check", "--check-build")   # matexrun's --check-build is Horovod's spelling
    return (any(flag in sys.argv[1:] for flag in flags)
            and os.path.basename(sys.argv[0]) in ("-m", "matexrun"))


# setup.py requires no TensorFlow flavour (any TensorFlow >= 2.21 will do): check here,
# from the installed metadata, without importing TensorFlow
if not _self_check():
    _compat_module.require_tensorflow()

# before MPI starts (mpi4py.MPI is imported later, by MaTEx or the script): a rank that
# waits in MPI yields its core (matex._cpu; MATEX_MPI_WAIT=poll keeps Open MPI's polling)
from matex import _cpu as _cpu_module  # noqa: E402

_cpu_module.set_mpi_wait_policy()
_cpu_module.set_mpi_transports()    # on one node, no 1-s libfabric probe in MPI_Init

if _config.ft_requested():
    # Under ULFM (mpiexec --with-ft ulfm) MPI_Finalize can wait forever on the
    # failure detector once a rank has died: skip it, as a crashed rank would.
    # Exit codes are kept. Effective if mpi4py.MPI is not imported yet.
    import mpi4py as _mpi4py

    _mpi4py.rc.finalize = False

from matex._runtime import comm, init, local_rank, local_size, rank, size  # noqa: E402
from matex import _lazy  # noqa: E402
from matex import errors  # noqa: E402 - typed errors; imports neither MPI nor TF
from matex import _runtime as _runtime_module  # noqa: E402


def _start_observers(core):
    # flight recorder, SIGUSR1 dumps and stall inspector; MATEX_TIMELINE (each once)
    from matex import _stall, timeline

    _stall.start(core)
    timeline.autostart()


_runtime_module.on_core_ready(_start_observers)

# `kill -USR1` dumps a rank (never kills it) from now on, also before the core loads
from matex import _stall as _stall_module  # noqa: E402

_stall_module.install_early_signal_handler()

# in a job of several ranks, an uncaught exception on one rank ends the job instead of
# leaving the others waiting in a collective for ever (not under ULFM: there that rank
# just exits and the others recover)
from matex import _resilience as _resilience_module  # noqa: E402

_resilience_module.install_excepthook()

# MaTEx's custom Keras layers (StageBoundary, the tensor-parallel layers) load with
# keras.saving.load_model after `import matex`: registered once Keras is loaded
from matex.parallel import _saving as _layer_saving  # noqa: E402

_layer_saving.install()

# MaTEx's op types are registered once TensorFlow is loaded: a graph saved by an MPI job
# (import_meta_graph, a frozen GraphDef) imports in a later process, MPI job or not
from matex.legacy import _saved_graphs  # noqa: E402 - imports neither MPI nor TF

if not _self_check():   # the self-check reports what is built; it builds nothing
    _saved_graphs.register_ops_when_tensorflow_loads()

__all__ = [
    "init", "rank", "size", "local_rank", "local_size", "comm",
    "allreduce", "broadcast", "allgather", "broadcast_variables",
    "DistributedOptimizer", "DistributedGradientTape", "mpi_error_class", "shard", "is_sharded",
    "on_rank_loss", "run_resilient", "errors",
    "sparse_allreduce", "stats", "LocalSGD", "DiLoCo", "flush",
    "grouped_allreduce", "barrier", "grouped_allgather", "grouped_reducescatter",
    "broadcast_object", "broadcast_object_fn", "allgather_object",
    "alltoall", "reducescatter", "should_commit", "clear_session",
]

_LAZY = {
    "allreduce": "matex._collectives",
    "broadcast": "matex._collectives",
    "allgather": "matex._collectives",
    "broadcast_variables": "matex._collectives",
    "mpi_error_class": "matex.errors",
    "DistributedOptimizer": "matex._optimizer",
    "DistributedGradientTape": "matex._tape",
    "shard": "matex._batch_slicing",
    "is_sharded": "matex._batch_slicing",
    "on_rank_loss": "matex._resilience",
    "run_resilient": "matex._recovery",
    "sparse_allreduce": "matex._sparse",       # SparCML-style sparse allreduce (#14)
    "stats": "matex._stats",                   # bytes on the wire per step and variable (#14)
    "LocalSGD": "matex.localsgd",              # fewer synchronisations (#14)
    "DiLoCo": "matex.localsgd",
    "flush": "matex._delayed",                 # apply delay=1's last gradient (#14)
    "grouped_allreduce": "matex._collectives",  # Horovod's API (#25)
    "barrier": "matex._collectives",
    "grouped_allgather": "matex._grouped",
    "grouped_reducescatter": "matex._grouped",
    "broadcast_object": "matex._objects",
    "broadcast_object_fn": "matex._objects",
    "allgather_object": "matex._objects",
    "alltoall": "matex._collectives",          # Horovod's API (#25)
    "reducescatter": "matex._collectives",
    "should_commit": "matex._commit",          # one commit vote per step (#32)
    "clear_session": "matex._state",           # one reset of MaTEx's caches (#32)
}


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:   # type checkers and IDEs see the lazy names' own signatures
    from matex._batch_slicing import is_sharded, shard
    from matex._collectives import allgather, allreduce, broadcast, broadcast_variables
    from matex._collectives import barrier, grouped_allreduce
    from matex._collectives import alltoall, reducescatter
    from matex._grouped import grouped_allgather, grouped_reducescatter
    from matex._objects import allgather_object, broadcast_object, broadcast_object_fn
    from matex._commit import should_commit
    from matex._delayed import flush
    from matex._optimizer import DistributedOptimizer
    from matex._recovery import run_resilient
    from matex._resilience import on_rank_loss
    from matex._sparse import sparse_allreduce
    from matex._state import clear_session
    from matex._stats import stats
    from matex._tape import DistributedGradientTape
    from matex.errors import mpi_error_class
    from matex.localsgd import DiLoCo, LocalSGD

# TensorFlow is imported on first use of a TF-facing name, so that
# `import matex` stays cheap (and usable for launching and readers).
__getattr__, __dir__ = _lazy.attach(__name__, _LAZY, __all__)
