"""Process-wide MaTEx state: the MPI communicator in use.

The communicator is state, not a constant: ``_set_comm`` replaces it (the
resilience layer swaps in a shrunk one), and every reader, Python or C++,
asks for the current one at the time of use.
"""

import threading
import warnings

_lock = threading.RLock()


def _run_as_is(function):
    """Mark ``function`` so TensorFlow's AutoGraph calls it unconverted.

    It is plain Python that creates ops (or none): converting it, and all it
    calls on first use (loading, building), only yields warnings. This is the
    mark ``tf.autograph.experimental.do_not_convert`` sets, without its
    per-call wrapper (eager collectives are on the hot path).
    """
    function.autograph_info__ = frozenset()
    return function
_comm = None        # mpi4py communicator every collective uses
_local = None       # ranks of _comm sharing this node


@_run_as_is
def init(comm=None):
    """Start MaTEx on ``comm`` (default: a duplicate of ``MPI.COMM_WORLD``).

    Idempotent: later calls without ``comm`` do nothing. Every public function
    calls it implicitly, so calling it yourself is optional.
    """
    with _lock:
        if _comm is not None and comm is None:
            return
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn(
                "MPI was initialised without MPI_THREAD_MULTIPLE; MaTEx runs "
                "collectives on TensorFlow's threads, so do not call mpi4py "
                "concurrently with training", RuntimeWarning, stacklevel=2)
        if comm is not None:
            _set_comm(comm)
            return
        from matex import _resilience

        if _resilience.mode() == "ulfm":
            _resilience.start()
        else:
            _set_comm(MPI.COMM_WORLD.Dup())


def _set_comm(comm):
    """Make ``comm`` the communicator of every later collective (collective call)."""
    global _comm, _local
    from mpi4py import MPI

    with _lock:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        _comm, _local = comm, local
        from matex import _native

        if _native._core is not None:
            _native._core.set_communicator(MPI._handleof(comm))


def _core():
    """The pybind11 core, pointed at the current communicator."""
    from mpi4py import MPI

    from matex import _native

    init()
    loaded = _native._core is not None
    module = _native.core()
    if not loaded:
        module.set_communicator(MPI._handleof(_comm))
    return module


@_run_as_is
def comm():
    """The mpi4py communicator MaTEx currently uses (it may be replaced after a failure)."""
    init()
    return _comm


@_run_as_is
def rank():
    """This process's rank in the current communicator."""
    return comm().Get_rank()


@_run_as_is
def size():
    """Number of ranks in the current communicator."""
    return comm().Get_size()


@_run_as_is
def local_rank():
    """This process's rank among the ranks on the same node."""
    init()
    return _local.Get_rank()


@_run_as_is
def local_size():
    """Number of ranks on this node."""
    init()
    return _local.Get_size()
