"""Point-to-point transfers as TensorFlow ops: ``send``, ``recv``, ``sendrecv``.

Semantics. ``comm`` names a communicator slot (0: ``matex.comm()``; a grid's
``pipeline_slot`` / ``tensor_slot``); ranks are ranks of that slot's
communicator. Every ``send(t, dest, tag=k)`` must be matched by a
``recv(shape, dtype, source, tag=k)`` on ``dest`` (same slot), and transfers
between one pair with one tag are matched in the order they are issued. The
ops are stateful: inside ``tf.function`` they run in program order.

Checks. Before any data moves, the two ends exchange a small header (dtype
and shape): when the receiver expects something else than what the sender
sends, both ends raise ``tf.errors.InvalidArgumentError`` with the same
message (no hang, no garbage). A failed MPI call raises
``tf.errors.InternalError`` carrying the MPI error class
(``matex.mpi_error_class``). Every transfer is a flight-recorder entry
(send/receive/send-receive). All MPI calls are non-blocking and waited for
without holding a lock: a receive blocked on its peer never stalls another
thread's transfer or collective.

Gradients (pipeline stages):

* ``send(y, dest)`` returns a zero scalar *token* of ``y``'s dtype. Its
  gradient receives dL/dy from ``dest``. A stage that sends its output
  backpropagates with ``tape.gradient(token, variables)`` (or adds the token,
  which is zero, to a loss): the receive of dL/dy happens in the backward pass.
* ``recv`` reads a hidden trainable zero scalar (one per dtype, never part of
  a model) as the op's token input, so any ``GradientTape`` that watches
  accessed variables (the default, Keras's train step included) records the
  receive. When backprop reaches it, its gradient sends dL/dx to ``source``
  (and the hidden scalar gets a zero gradient, discarded). So a stage chain
  ``x = recv(...); y = f(x); t = send(y, next)`` backpropagates end to end
  with one ``tape.gradient(t, f.trainable_variables)`` per rank, the
  backward transfers issued in reverse order on both ends.
  Differentiating through a transfer therefore needs its peer to
  differentiate through the matching one (else the backward transfer waits).
* ``sendrecv(x, dest, source)``: the gradient is the reverse transfer, dL/dx
  = sendrecv(dL/dy, dest=source, source=dest).

Gradient transfers use the forward transfer's tag and slot (they go the other
way, so they never match a forward message).
"""

from __future__ import annotations

import threading
from typing import Sequence

import tensorflow as tf

from matex import _state
from matex._issue import _as_tensor, _issue, _ops
from matex._runtime import _run_as_is

MAX_TAG = 8192   # kMaxP2PTag in tf_ops/core/p2p.h



def _check(tag, *ranks):
    if not 0 <= int(tag) < MAX_TAG:
        raise ValueError("tag must be in [0, %d), not %r" % (MAX_TAG, tag))
    for what, r in ranks:
        if int(r) < 0:
            raise ValueError("%s must be a rank (>= 0), not %r" % (what, r))


def _shape_tensor(shape):
    if isinstance(shape, tf.TensorShape):
        if not shape.is_fully_defined():
            raise ValueError("recv needs a fully defined shape, got %s" % shape)
        shape = shape.as_list()
    return tf.cast(tf.convert_to_tensor(shape), tf.int64)


# dtype -> the hidden recv anchor variable; traced functions read it, so it is never dropped
_anchors = _state.table("parallel.p2p.anchors", lifetime="process")
_anchor_lock = threading.Lock()


def _token(dtype):
    """The hidden trainable zero scalar a recv reads (see the module docstring)."""
    if not dtype.is_floating:
        return tf.zeros([], dtype)   # integers have no gradient: nothing to attach
    with _anchor_lock:
        anchor = _anchors.get(dtype)
        if anchor is None:
            with tf.init_scope():
                anchor = tf.Variable(tf.zeros([], dtype), trainable=True,
                                     name="matex_recv_anchor")
            _anchors[dtype] = anchor
    return tf.convert_to_tensor(anchor)


@_run_as_is
def send(tensor: tf.Tensor, dest: int, comm: int = 0, tag: int = 0) -> tf.Tensor:
    """Send ``tensor`` to rank ``dest`` of communicator slot ``comm``.

    Returns a zero scalar of the tensor's dtype: the token whose gradient
    receives dL/d``tensor`` from ``dest`` (module docstring).
    Raises tf.errors.InvalidArgumentError (on both ends) when ``dest``
    receives another dtype or shape.
    """
    _check(tag, ("dest", dest))
    tensor = _as_tensor(tensor, "parallel.send")
    return _issue(_ops().matex_send, tensor, dest=int(dest), tag=int(tag), comm=int(comm))


@_run_as_is
def recv(shape: Sequence[int] | tf.TensorShape | tf.Tensor, dtype: tf.dtypes.DType | str,
         source: int, comm: int = 0, tag: int = 0) -> tf.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` sent by rank ``source``.

    ``shape`` is a list, a fully defined ``TensorShape`` or an int tensor (a
    dynamic shape). Its gradient sends dL/dx back to ``source``.
    """
    _check(tag, ("source", source))
    dtype = tf.as_dtype(dtype)
    token = _token(dtype)
    _as_tensor(token, "parallel.recv")   # dtype check
    return _issue(_ops().matex_recv, token, _shape_tensor(shape), source=int(source),
                  tag=int(tag), comm=int(comm))


@_run_as_is
def sendrecv(tensor: tf.Tensor, dest: int, source: int,
             recv_shape: Sequence[int] | tf.TensorShape | tf.Tensor,
             recv_dtype: tf.dtypes.DType | str, comm: int = 0, tag: int = 0) -> tf.Tensor:
    """Send ``tensor`` to ``dest`` and receive a ``recv_shape`` tensor from ``source``, overlapped.

    Deadlock-free in rings and exchanges (every rank sends and receives at
    once). The gradient is the reverse transfer.
    """
    _check(tag, ("dest", dest), ("source", source))
    tensor = _as_tensor(tensor, "parallel.sendrecv")
    recv_dtype = tf.as_dtype(recv_dtype)
    _as_tensor(tf.zeros([], recv_dtype), "parallel.sendrecv")
    return _issue(_ops().matex_send_recv, tensor, _shape_tensor(recv_shape), R=recv_dtype,
                  dest=int(dest), source=int(source), tag=int(tag), comm=int(comm))


# ---- gradients --------------------------------------------------------------

@tf.RegisterGradient("MatexSend")
def _send_grad(op, grad):
    # dL/dtensor comes from the rank the tensor went to.
    x = op.inputs[0]
    return _ops().matex_recv(tf.zeros([], x.dtype), tf.shape(x, out_type=tf.int64),
                             source=op.get_attr("dest"), tag=op.get_attr("tag"),
                             comm=op.get_attr("comm"))


@tf.RegisterGradient("MatexRecv")
def _recv_grad(op, grad):
    # dL/dx goes back to the rank x came from; the token's gradient is the
    # send's zero token (a data dependency that keeps the send in the graph).
    token = _ops().matex_send(grad, dest=op.get_attr("source"), tag=op.get_attr("tag"),
                              comm=op.get_attr("comm"))
    return [token, None]


@tf.RegisterGradient("MatexSendRecv")
def _sendrecv_grad(op, grad):
    x = op.inputs[0]
    dx = _ops().matex_send_recv(grad, tf.shape(x, out_type=tf.int64), R=x.dtype,
                                dest=op.get_attr("source"), source=op.get_attr("dest"),
                                tag=op.get_attr("tag"), comm=op.get_attr("comm"))
    return [dx, None]
