"""Python objects across ranks: broadcast and allgather of anything picklable.

Horovod's ``broadcast_object``, ``broadcast_object_fn`` and
``allgather_object``. Objects are pickled and sent with mpi4py over the
communicator MaTEx uses at the time of the call (read per call, so a
communicator replaced after a rank loss is never stale): for slot 0 its
control duplicate (``matex._runtime.control()``), which keeps these messages
apart from the data collectives; for slot ``k`` the slot's communicator.

A rank's pickling or unpickling error becomes one error on every rank
(``matex._everywhere``): a ``RemoteError`` (a ``matex.errors.MatexError``)
naming the rank and its exception, never a peer left waiting. These are eager-only (Python objects
have no place in a graph).
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from matex import _runtime
from matex._everywhere import RemoteError, on_every_rank
from matex._runtime import _run_as_is

__all__ = ["broadcast_object", "broadcast_object_fn", "allgather_object"]


def _communicator(comm):
    if comm is None or comm == 0:
        return _runtime.control()
    return _runtime.slot_comm(int(comm))


def _dumps(obj):
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


@_run_as_is
def broadcast_object(obj: Any, root_rank: int = 0, comm: int | None = None) -> Any:
    """Rank ``root_rank``'s ``obj`` on every rank of communicator slot ``comm``.

    Collective: every rank calls it (what non-root ranks pass is ignored).
    The root gets its own ``obj`` back; the others get an unpickled copy.
    ``comm``: None or 0 for MaTEx's communicator, else a slot number.

    Raises:
      RemoteError: on every rank, if the root cannot pickle ``obj``, a rank
        cannot unpickle it, or ``root_rank`` is not a rank of ``comm``.
    """
    c = _communicator(comm)
    me, size = c.Get_rank(), c.Get_size()

    def pack():
        if not 0 <= root_rank < size:
            raise ValueError("root_rank %r is not a rank of a communicator of %d rank(s)"
                             % (root_rank, size))
        return _dumps(obj) if me == root_rank else None

    payload = on_every_rank(c, pack, error_type=RemoteError,
                            what="matex.broadcast_object: pickling on the root")
    payload = c.bcast(payload, root=root_rank)
    return on_every_rank(c, lambda: obj if me == root_rank else pickle.loads(payload),
                         error_type=RemoteError,
                         what="matex.broadcast_object: unpickling")


def broadcast_object_fn(root_rank: int = 0, comm: int | None = None) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's helper).

    ``f(obj)`` is ``broadcast_object(obj, root_rank, comm)``; the communicator
    is looked up at each call.
    """
    def broadcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank=root_rank, comm=comm)

    return broadcast


@_run_as_is
def allgather_object(obj: Any, comm: int | None = None) -> list:
    """Every rank's ``obj``, as a list in rank order, on every rank of slot ``comm``.

    Collective. This rank's entry is ``obj`` itself; the others are
    unpickled copies.

    Raises:
      RemoteError: on every rank, if a rank cannot pickle its ``obj`` or
        unpickle another's.
    """
    c = _communicator(comm)
    me = c.Get_rank()
    mine = on_every_rank(c, _dumps, obj, error_type=RemoteError,
                         what="matex.allgather_object: pickling")
    payloads = c.allgather(mine)
    return on_every_rank(
        c, lambda: [obj if r == me else pickle.loads(p) for r, p in enumerate(payloads)],
        error_type=RemoteError, what="matex.allgather_object: unpickling")
