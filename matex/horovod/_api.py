"""Horovod's TensorFlow API with Horovod's semantics, on MaTEx's collectives.

Used by ``matex.horovod.tensorflow`` (which re-exports it) and the Keras
modules. The reduce-op constants are Horovod's integers; ``average=`` is
Horovod's deprecated spelling of ``op=``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from matex import _collectives, _grouped, _objects, _process_sets, _runtime, _state, _transparent
from matex.errors import is_mismatch
from matex._process_sets import ProcessSet, global_process_set
from matex.horovod import _join
from matex.horovod._compression import Compression, Compressor

# Horovod's reduce-op constants (horovod.common.basics) and MaTEx's names for them
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max",
             Product: "product"}


def _op_name(op: int) -> str:
    if op not in _OP_NAMES:
        raise ValueError("op must be one of hvd.Average, Sum, Adasum, Min, Max, Product, "
                         "not %r" % (op,))
    return _OP_NAMES[op]


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    """Horovod's ``average=`` (deprecated) as an ``op``; both given is a ValueError."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        return op
    if average is not None:
        import warnings

        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


@contextlib.contextmanager
def _horovod_errors() -> Iterator[None]:
    """Ranks that disagree on a collective: Horovod's ``FailedPreconditionError``.

    Eagerly the error is converted here (recognised by its payload). The ops
    made in a graph (a TF1 ``Session``'s or ``tf.function``'s) raise it
    themselves when they run: a ``Session`` drops the payload.
    """
    with _collectives.mismatch_code(tf.errors.FAILED_PRECONDITION):
        try:
            yield
        except tf.errors.OpError as exc:
            if is_mismatch(exc) and not isinstance(exc, tf.errors.FailedPreconditionError):
                raise tf.errors.FailedPreconditionError(exc.node_def, exc.op,
                                                        exc.message) from exc
            raise


def _as_horovod_errors(function: Callable) -> Callable:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _horovod_errors():
            return function(*args, **kwargs)

    return call


# ---- the process ------------------------------------------------------------

def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start MaTEx (Horovod's ``hvd.init``); ``comm`` an mpi4py communicator or None.

    ``process_sets``: ``hvd.ProcessSet`` objects to register (collective;
    a duplicate is a ValueError, as in Horovod), or "dynamic" (none now;
    ``add_process_set`` works either way). A list of world ranks (Horovod's
    other form of ``comm``) is not supported: a ValueError.
    """
    if comm is not None and not hasattr(comm, "Get_rank"):
        raise ValueError("hvd.init(comm=...) takes an mpi4py communicator here, not %r" % (comm,))
    _runtime.init(comm)
    _now.shut_down = False
    _transparent.explicit_layer_in_use("horovod")   # the transparent patches stand down
    global_process_set.ranks = list(range(_runtime.size()))
    if comm is not None:
        global_process_set.mpi_comm = comm
    if process_sets is not None and not (isinstance(process_sets, str)
                                         and process_sets.lower() == "dynamic"):
        _process_sets.init_sets(list(process_sets))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (collective); returns it with its id.

    Ranks are global ranks; a set with the ranks of an existing one is a
    ValueError (Horovod's rules; ``matex._process_sets.add``).
    """
    _runtime.init()
    return _process_sets.add(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective); False if it was not registered."""
    return _process_sets.remove(process_set)


_now = _state.namespace("horovod.api",
                        shut_down=False)   # hvd.shutdown() ran and no hvd.init() since


def shutdown() -> None:
    """Horovod's ``hvd.shutdown``: until ``hvd.init()`` runs again, ``is_initialized()`` is
    False and ``rank``/``size``/``local_rank``/``local_size`` raise Horovod's ValueError.
    MPI itself ends with the process (MaTEx's collectives keep working)."""
    _now.shut_down = True


def is_initialized() -> bool:
    """Whether ``init`` (explicit or implicit) has run, and no ``shutdown`` since."""
    return _runtime.started() and not _now.shut_down


def _after_init(function: Callable[[], int]) -> Callable[[], int]:
    @functools.wraps(function)
    def read() -> int:
        if _now.shut_down:
            raise ValueError("Horovod has not been initialized; use hvd.init().")
        return function()

    return read


rank, size, local_rank, local_size = (_after_init(f) for f in (
    _runtime.rank, _runtime.size, _runtime.local_rank, _runtime.local_size))


def _cross() -> tuple[int, int, bool]:
    """(cross rank, cross size, homogeneous) of the communicator in use: computed when it
    was set (at init, after a ULFM shrink), so asking on one rank alone never hangs."""
    return _runtime.cross_figures()


def cross_rank() -> int:
    """This node's index among the nodes (the rank among ranks of the same local rank)."""
    return _cross()[0]


def cross_size() -> int:
    """The number of nodes holding a rank of this local rank."""
    return _cross()[1]


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return _cross()[2]


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (MaTEx requires it)."""
    _runtime.init()
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True: MaTEx's collectives are MPI."""
    return True


def mpi_built() -> bool:
    """True: MaTEx is built on MPI."""
    return True


def gloo_enabled() -> bool:
    """False: MaTEx has no Gloo controller."""
    return False


def gloo_built() -> bool:
    """False: MaTEx has no Gloo controller."""
    return False


def nccl_built() -> int:
    """0: MaTEx does not use NCCL (Horovod returns NCCL's version, or 0)."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """False: MaTEx's collectives run on host memory."""
    return False


def rocm_built() -> bool:
    """False: MaTEx's collectives run on host memory."""
    return False


def rank_op(name: str | None = None) -> tf.Tensor:
    """This rank, as an int32 tensor read when the op runs."""
    return tf.cast(_collectives.comm_info()[0], tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of the process set ``process_set_id``), as an int32 tensor.

    Read when the op runs on the set's members (so it follows a shrink); a
    constant on the ranks outside the set.
    """
    ps = _process_sets.get(process_set_id)
    if process_set_id == 0 or not ps.included():
        if process_set_id != 0:
            return tf.constant(ps.size(), tf.int32, name=name)
        return tf.cast(_collectives.comm_info()[1], tf.int32, name=name)
    return tf.cast(_collectives.comm_info(_process_sets.slot_of(ps))[1], tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 (int32) if this rank belongs to the process set ``process_set_id``, else 0."""
    return tf.constant(int(bool(_process_sets.get(process_set_id).included())), tf.int32,
                       name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its node, as an int32 tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this node, as an int32 tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


# ---- collectives ------------------------------------------------------------

def _no_process_set(process_set: Any) -> None:
    """Check a training API's ``process_set``: None, or a registered ``hvd.ProcessSet``."""
    if process_set is None or process_set is global_process_set:
        return
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        raise ValueError("process_set must be a registered hvd.ProcessSet, not %s"
                         % (process_set,))
    _process_sets.get(process_set.process_set_id)


def _slot(process_set: ProcessSet | None) -> int:
    """The communicator slot of ``process_set`` (0: every rank); a non-member raises."""
    return _process_sets.slot_of(process_set)


def _set_size(process_set: ProcessSet | None) -> int:
    if process_set is None or process_set.process_set_id == 0:
        return size()
    return process_set.size() or 0


def _averaged_gradient(tensor: tf.Tensor, comm: int = 0) -> tf.Tensor:
    """Identity whose gradient is divided by the number of ranks (of slot ``comm``).

    MaTEx's broadcast and allgather gradients sum over ranks, Horovod's
    average: the compat layer puts this in front of them.
    """
    return _gradient_scaled(tensor, divide=True, comm=comm)


def _gradient_scaled(tensor: tf.Tensor, divide: bool, comm: int = 0) -> tf.Tensor:
    """Identity whose gradient (made dense) is divided or multiplied by the number of ranks
    of slot ``comm``."""
    if not (tensor.dtype.is_floating or tensor.dtype.is_complex):
        return tensor

    @tf.custom_gradient
    def scaled(x):
        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            n = tf.cast(_collectives.comm_info(comm)[1], dy.dtype)
            return dy / n if divide else dy * n

        return tf.identity(x), grad

    return scaled(tensor)


def _gradient_in_dtype(tensor: tf.Tensor) -> tf.Tensor:
    """Identity whose incoming gradient is cast to ``tensor``'s dtype.

    Horovod accepts an output gradient of another float dtype (its tests pass
    float32 ones for float64 outputs); MaTEx's grouped gradients are fused by
    dtype, so they are cast first.
    """
    if not tensor.dtype.is_floating:
        return tensor

    @tf.custom_gradient
    def cast(x):
        def grad(dy):
            return tf.cast(tf.convert_to_tensor(dy), x.dtype)

        return tf.identity(x), grad

    return cast(tensor)


@_as_horovod_errors
def allreduce(tensor: tf.Tensor | tf.IndexedSlices, average: bool | None = None,
              device_dense: str = "", device_sparse: str = "",
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor | tf.IndexedSlices:
    """Reduce ``tensor`` over all ranks (Horovod's ``hvd.allreduce``; default op Average).

    A ``tf.IndexedSlices`` is allgathered (values and indices), divided by
    the number of ranks for Average, as Horovod does. ``prescale_factor``
    multiplies the input before the reduction, ``postscale_factor`` the
    result after it. ``process_set``: reduce over its ranks only (a rank
    outside it gets ``tf.errors.InvalidArgumentError``).
    """
    comm = _slot(process_set)
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if op == Adasum:
            raise NotImplementedError("The Adasum reduction does not support sparse tensors: "
                                      "pass sparse_as_dense=True")
        if op not in (Sum, Average):
            raise NotImplementedError("Only Sum and Average ops are supported with "
                                      "tf.IndexedSlices")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with "
                                      "tf.IndexedSlices")
        values = allgather(tensor.values, process_set=process_set)
        indices = allgather(tensor.indices, process_set=process_set)
        if op == Average:   # the set's size when the op runs (a shrink changes it)
            set_id = 0 if process_set is None else process_set.process_set_id
            values = values / tf.cast(size_op(set_id), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    tensor = tf.convert_to_tensor(tensor)
    compressed, context = compression.compress(tensor)
    if comm == 0:   # over every rank: announced, for ranks in hvd.join() (_join)
        compressed = _join.announced_allreduce(
            compressed, op, prescale_factor != 1.0 or postscale_factor != 1.0)
    # MaTEx's collectives apply Horovod's scaling rules (grouped_allreduce the same ones)
    reduced = _collectives.allreduce(compressed, op=_op_name(op), name=name, comm=comm,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)
    return compression.decompress(reduced, context)


@_as_horovod_errors
def grouped_allreduce(tensors: Sequence[tf.Tensor], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None) -> list[tf.Tensor]:
    """Reduce several tensors at once (one fused MPI call per dtype), as ``allreduce`` each."""
    comm = _slot(process_set)
    op = handle_average_backwards_compatibility(op, average)
    if not tensors:
        return []
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
                for t in tensors]
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    by_dtype: dict[tf.DType, list[int]] = {}
    for i, (t, _) in enumerate(pairs):
        by_dtype.setdefault(t.dtype, []).append(i)
    reduced: list[Any] = [None] * len(pairs)
    for indices in by_dtype.values():   # the scaling rules of allreduce, in the collective
        outs = _collectives.grouped_allreduce(
            [pairs[i][0] for i in indices], op=_op_name(op), comm=comm,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        for i, out in zip(indices, outs):
            reduced[i] = out
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


@_as_horovod_errors
def allgather(tensor: tf.Tensor, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along axis 0 (first dimensions may differ).

    Its gradient is Horovod's: the output gradient averaged over ranks, this
    rank's rows. With ``process_set``, over its ranks only.
    """
    comm = _slot(process_set)
    tensor = tf.convert_to_tensor(tensor)
    return _collectives.allgather(_averaged_gradient(tensor, comm), name=name, comm=comm)


@_as_horovod_errors
def broadcast(tensor: tf.Tensor, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False, process_set: Any = None) -> tf.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank.

    Its gradient is Horovod's: the output gradient averaged over ranks on the
    root, zero elsewhere. ``root_rank`` is a global rank, also with a
    ``process_set`` (as in Horovod).
    """
    comm = _slot(process_set)
    root = _process_sets.root_in(process_set, root_rank)
    tensor = tf.convert_to_tensor(tensor)
    return _collectives.broadcast(_averaged_gradient(tensor, comm), root=root, name=name, comm=comm)


@_as_horovod_errors
def broadcast_(variables: Iterable[tf.Variable], root_rank: int, name: str | None = None,
               process_set: Any = None) -> list[tf.Variable]:
    """Assign rank ``root_rank``'s values to ``variables`` in place.

    Eagerly it returns the variables; in a graph, the assignments' values
    (running them broadcasts), as Horovod does.
    """
    comm = _slot(process_set)
    root = _process_sets.root_in(process_set, root_rank)
    variables = list(variables)
    if not tf.executing_eagerly():
        return [v.assign(_collectives.broadcast(v, root=root, comm=comm)) for v in variables]
    for v in variables:
        v.assign(_collectives.broadcast(v, root=root, comm=comm))
    return variables


@_as_horovod_errors
def broadcast_variables(variables: Iterable[tf.Variable], root_rank: int,
                        process_set: Any = None, inplace: bool = False) -> Any:
    """Give every rank rank ``root_rank``'s values of ``variables``.

    Eagerly it assigns and returns None; in a graph it returns the group of
    assign ops, as Horovod does.
    """
    comm = _slot(process_set)
    root = _process_sets.root_in(process_set, root_rank)
    variables = list(variables)
    if tf.executing_eagerly():
        _collectives.broadcast_variables(variables, root=root, comm=comm)
        return None
    return tf.group(*[v.assign(_collectives.broadcast(v, root=root, comm=comm)) for v in variables])


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast TF1's global variables (graph mode only, as in Horovod)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def join() -> tf.Tensor:
    """Serve the other ranks' announced reductions with zeros until every rank has joined.

    Returns the last rank to join (an int32 scalar tensor), the same on every
    rank. Eager only. See ``matex.horovod._join`` for which reductions are
    announced (``MATEX_HOROVOD_JOIN``).
    """
    return _join.join(allreduce)


def _executing_eagerly() -> bool:
    """Whether ops run eagerly now (Horovod's ``horovod.tensorflow.util`` helper)."""
    return tf.executing_eagerly()


# ---- collectives MaTEx gained for Horovod ------------------------------------------


@_as_horovod_errors
def barrier(process_set: Any = None) -> Any:
    """Wait until every rank (of ``process_set``) has reached this point."""
    return _collectives.barrier(comm=_slot(process_set))


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: str | None = None, process_set: Any = None) -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank (``matex.broadcast_object``)."""
    comm = _slot(process_set)
    return _objects.broadcast_object(obj, _process_sets.root_in(process_set, root_rank),
                                  comm=comm)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = None) -> Callable[[Any], Any]:
    """A function broadcasting its argument from ``root_rank``."""
    comm = _slot(process_set)
    return _objects.broadcast_object_fn(_process_sets.root_in(process_set, root_rank),
                                     comm=comm)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> list:
    """Every rank's picklable ``obj``, in rank order (``matex.allgather_object``)."""
    return _objects.allgather_object(obj, comm=_slot(process_set))


@_as_horovod_errors
def grouped_allgather(tensors: Sequence[tf.Tensor], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: Any = None) -> list[tf.Tensor]:
    """``allgather`` of several tensors at once (Horovod's averaged gradients)."""
    comm = _slot(process_set)
    out = _grouped.grouped_allgather(
        [_averaged_gradient(tf.convert_to_tensor(t), comm) for t in tensors], name=name,
        comm=comm)
    return [_gradient_in_dtype(o) for o in out]


@_as_horovod_errors
def reducescatter(tensor: tf.Tensor, device_dense: str = "",
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  name: str | None = None, process_set: Any = None,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over ranks and give each rank its block of rows (``matex.reducescatter``)."""
    comm = _slot(process_set)
    compressed, context = compression.compress(tf.convert_to_tensor(tensor))
    # Horovod's gradient is the size times MaTEx's (the allgathered output gradient,
    # scaled by the factors, for Average; size times that for Sum)
    compressed = _gradient_scaled(compressed, divide=False, comm=comm)
    out = _collectives.reducescatter(compressed, op=_op_name(op), name=name, comm=comm,
                              prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor)
    return compression.decompress(out, context)


@_as_horovod_errors
def grouped_reducescatter(tensors: Sequence[tf.Tensor], device_dense: str = "",
                          compression: type[Compressor] = Compression.none,
                          op: int = Average, process_set: Any = None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """``reducescatter`` of several tensors at once (``matex.grouped_reducescatter``)."""
    comm = _slot(process_set)
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    out = _grouped.grouped_reducescatter([_gradient_scaled(c, divide=False, comm=comm)
                                       for c, _ in pairs],
                                      op=_op_name(op), comm=comm,
                                      prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor)
    return [_gradient_in_dtype(compression.decompress(o, ctx))
            for o, (_, ctx) in zip(out, pairs)]


@_as_horovod_errors
def alltoall(tensor: tf.Tensor, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: Any = None) -> Any:
    """Send block i of ``tensor`` (rows per ``splits``) to rank i (``matex.alltoall``).

    Returns the received rows, and with ``splits`` given also the received
    splits (a pair), as Horovod does.
    """
    output, received = _collectives.alltoall(tensor, splits=splits, name=name,
                                      comm=_slot(process_set))
    return (output, received) if splits is not None else output
