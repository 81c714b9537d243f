"""Issuing a MaTEx collective op: the op library, the op's number in a TF1 graph, the
mismatch code its kernel reports, the barrier a weight update sets, and the dtype and
op checks.

The layer below ``matex._collectives`` (the public collectives), ``matex._adasum`` and
``matex.parallel._p2p``, which build on it without importing each other.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf

from matex import _native, _runtime, _state

REDUCE_OPS = ("sum", "average", "min", "max", "product")
DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64,
          tf.uint8, tf.int8, tf.uint16, tf.int16, tf.bool)


# graph -> op every later collective waits for
_barriers = _state.weak_table("issue.barriers", "process")


_now = _state.namespace("issue", "process",
                       loaded=None)   # the op library, once the C++ side holds a communicator

_SEQ_ATTR = "_matex_seq"   # a MaTEx op's number in its TF1 graph (read by the kernels)
# TF1 graph -> the number its next MaTEx op gets
_next_seq = _state.weak_table("issue.next_seq", "process")
_UNSCHEDULED = frozenset({"matex_comm_info"})   # ops that never communicate


class _Numbered:
    """The op library, whose communicating ops in a TF1 graph carry their creation number.

    Inside ``tf.function`` automatic control dependencies keep stateful ops in
    program order, and eagerly Python's order holds. A TF1 graph run by a
    ``Session`` has neither: independent collectives may start in any order,
    and in a different one on each rank, which pairs one rank's tensor with
    another rank's other tensor (wrong sums, no error). Chaining every op to
    the one created before it fixed the order but made each fetched collective
    run every earlier one too (and their inputs: a broadcast run alone then
    needed the training placeholders fed). Instead each MaTEx op made in a TF1
    graph gets a number (the node attribute ``_matex_seq``: creation order),
    and nothing else: it runs when fetched and only then. Before each
    ``Session.run`` the scheduler (``matex.legacy._schedule``) computes the
    numbered ops that run will execute and has the kernels run them in that
    order on every rank. Eager and ``tf.function`` calls pay one check.
    """

    def __init__(self, library):
        self._library = library

    def __getattr__(self, name):
        make = getattr(self._library, name)
        if name in _UNSCHEDULED:
            setattr(self, name, make)
            return make

        def numbered(*args, **kwargs):
            if tf.executing_eagerly() or tf.inside_function():
                return make(*args, **kwargs)
            return _numbered_in_graph(make, args, kwargs)

        numbered.__name__ = name
        setattr(self, name, numbered)   # looked up once per name
        return numbered


def _numbered_in_graph(make, args, kwargs):
    """``make(*args, **kwargs)`` in the default TF1 graph, numbered for the scheduler."""
    from tensorflow.core.framework import attr_value_pb2

    from matex import _compat
    from matex.legacy import _schedule

    graph = tf.compat.v1.get_default_graph()
    if _compat.tf1_control_flow_context(graph) is not None:
        raise NotImplementedError(
            "MaTEx collectives inside tf.compat.v1.cond / while_loop of a TF1 graph (v1 "
            "control flow) are not supported: such a branch may run 0 or many times, which "
            "ranks cannot agree on before the run. Compute the collective outside the "
            "cond/loop, or use control flow v2 (tf.compat.v1.enable_control_flow_v2()).")
    seq = _next_seq.get(graph, 0)
    _next_seq[graph] = seq + 1
    value = attr_value_pb2.AttrValue(i=seq)
    with _compat.graph_attr_scope(graph, {
            _SEQ_ATTR: lambda node: value if node.op.startswith("Matex") else None}):
        result = make(*args, **kwargs)
    _schedule.install()
    return result


_MISMATCH_CODE_ATTR = "_matex_mismatch_code"   # read by the kernels (kernels/common.h)


@contextlib.contextmanager
def mismatch_code(code: int) -> Iterator[None]:
    """MaTEx ops made in this scope, in a graph, report ranks that disagree with ``code``.

    ``code`` is a TensorFlow error code (``tf.errors.FAILED_PRECONDITION``);
    without this scope a mismatch is INVALID_ARGUMENT. Eager callers tell a
    mismatch by the error's payload (``matex.errors.is_mismatch``), which a
    TF1 ``Session`` drops; the code is kept. Eagerly the scope does nothing.
    """
    if tf.executing_eagerly():
        yield
        return
    from tensorflow.core.framework import attr_value_pb2

    from matex import _compat

    value = attr_value_pb2.AttrValue(i=int(code))
    graph = tf.compat.v1.get_default_graph()
    with _compat.graph_attr_scope(graph, {
            _MISMATCH_CODE_ATTR: lambda node: value if node.op.startswith("Matex") else None}):
        yield


def _ops():
    if _now.loaded is None:
        _runtime._core()  # communicator handed to the C++ side before any op runs
        _now.loaded = _Numbered(_native.tf_ops())
    return _now.loaded


def set_barrier(op):
    """Make every collective created later in ``op``'s ``tf.function`` graph wait for ``op``.

    Used after a weight update, so that a later collective that fails (a dead
    peer) can never interrupt an update halfway. Only in a function graph: its
    one call runs the whole step, update and later collectives together. In a
    TF1 graph each ``Session.run`` runs only what it fetches; a barrier there
    would make every later collective (a broadcast run alone, a metric) run the
    whole training step again. A ``Session.run`` that fetches an update and a
    later collective together runs them in the order the scheduler gives the
    collectives, not after the update.
    """
    if getattr(op.graph, "building_function", False):
        _barriers[op.graph] = op


def _after_barrier():
    if tf.executing_eagerly():
        return []
    op = _barriers.get(tf.compat.v1.get_default_graph())
    return [op] if op is not None else []


def _issue(make, *args, **kwargs):
    """``make(*args, **kwargs)`` with the op after the graph's barrier, if any."""
    barrier = _after_barrier()
    if not barrier:   # eagerly, or no weight update yet in this graph: nothing to wait for
        return make(*args, **kwargs)
    with tf.control_dependencies(barrier):
        return make(*args, **kwargs)


_DTYPE_SET = frozenset(DTYPES)   # DType.__eq__ is slow Python: test membership by hash


def _as_tensor(tensor, what):
    if not isinstance(tensor, tf.Tensor):   # already a tensor: no conversion on the hot path
        tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype not in _DTYPE_SET:
        raise TypeError(
            "matex.%s does not support dtype %s (supported: %s)"
            % (what, tensor.dtype.name, ", ".join(d.name for d in DTYPES)))
    return tensor


def _check_op(op):
    if op not in REDUCE_OPS:
        raise ValueError("op must be one of %s, not %r" % (", ".join(REDUCE_OPS), op))


def _check_bool(tensor, op, what):
    """Booleans reduce with min (and), max (or) and product (and) only: a sum leaves {0, 1}."""
    if (op == "sum" or op == "average") and tensor.dtype.is_bool:
        raise TypeError("matex.%s of bool tensors supports op min (logical and), max "
                        "(logical or) and product, not %r" % (what, op))


# 8- and 16-bit integers are summed, averaged and multiplied in int32: Open MPI's op/avx
# component saturates their MPI_SUM on vectors long enough for its AVX path (127 + 127 =
# 127 as int8; shorter vectors wrap), open-mpi/ompi #8045, closed as wontfix. Cast back,
# a sum or product in int32 wraps exactly as one in the narrow type would (2^8 and 2^16
# divide 2^32); an average is the exact mean, truncated.
