"""CPU defaults per rank: TensorFlow's compute threads, MPI's wait policy and the
transports MPI opens at start.

**Compute threads.**

TensorFlow sizes its intra-op pool to every core the process may run on. Under
``mpiexec`` several ranks share a node, and unbound (``matexrun``'s default) each
sees every core: two ranks on two cores run four compute threads, and a rank that
waits in a collective competes with its peer's computation. MaTEx sets
``TF_NUM_INTRAOP_THREADS`` to this rank's share of the node's cores when MPI
starts, before TensorFlow makes its thread pools, unless the user chose:

* ``TF_NUM_INTRAOP_THREADS`` set in the environment (TensorFlow's own setting);
* ``tf.config.threading.set_intra_op_parallelism_threads`` (it wins over the variable);
* ``MATEX_INTRA_OP_THREADS``: ``auto`` (the default, the share), ``tf`` (leave
  TensorFlow's default), or a number.

A process a rank starts inherits the variable; ``MATEX_INTRA_OP_THREADS_SET`` marks it
as MaTEx's, so that a MaTEx job started from it sizes its own ranks again.

A rank's share: each core this rank may run on counts ``1 / k`` when ``k`` ranks of
the node may run on it (one small allgather among the node's ranks at start), at
least one thread. TensorFlow reads the variable when it makes its runtime, so a
script that ran TensorFlow ops before MaTEx started keeps TensorFlow's default.

**Wait policy and transports** (Open MPI, set in the environment before MPI starts, the
user's own ``OMPI_MCA_*`` winning): a waiting rank yields its core
(``set_mpi_wait_policy``), and on one node the libfabric transport, which only costs a
one-second sleep in ``MPI_Init`` there, is left out (``set_mpi_transports``).
"""

from __future__ import annotations

import logging
import os

from matex import _config

log = logging.getLogger("matex")

YIELD_VAR = "OMPI_MCA_mpi_yield_when_idle"   # Open MPI's wait policy, read when MPI starts
SET_WAIT_VAR = "MATEX_MPI_WAIT_SET"           # the value MaTEx set, inherited by children
BTL_VAR = "OMPI_MCA_btl"                       # Open MPI's byte transports, read when MPI starts
SET_BTL_VAR = "MATEX_MPI_BTL_SET"
ONE_NODE_BTL = "^ofi"

TF_INTRA_OP_VAR = "TF_NUM_INTRAOP_THREADS"
THREADS_MARK_VAR = "MATEX_INTRA_OP_THREADS_SET"   # the value MaTEx set, inherited by children


def _users(var: str, mark_var: str) -> bool:
    """Whether ``var`` holds a value of the user's: set, and not the one MaTEx marked in
    ``mark_var`` (a MaTEx process's setting that a process it started inherited)."""
    current = os.environ.get(var, "").strip()
    return bool(current) and current != _config.variable(mark_var)


def _set_marked(var: str, mark_var: str, value: str) -> None:
    """Set ``var`` to ``value`` and mark it as MaTEx's (see ``_users``)."""
    os.environ[var] = os.environ[mark_var] = value


def _affinity() -> frozenset:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def share_of(mine: frozenset, everyones: list) -> int:
    """Threads for a rank that may run on cores ``mine`` when the node's ranks (itself
    included) may run on ``everyones``: its share of each core, summed, at least 1."""
    share = sum(1.0 / max(1, sum(core in cores for cores in everyones)) for core in mine)
    return max(1, int(share + 1e-9))


def size_pools(local) -> int | None:
    """Set ``TF_NUM_INTRAOP_THREADS`` for this rank (collective over ``local``, the node's
    ranks); returns the number set, or None when the user's choice stands."""
    choice = _config.intra_op_threads()
    user_set = _users(TF_INTRA_OP_VAR, THREADS_MARK_VAR)
    mine = _affinity()
    # every rank takes part in the allgather, whatever its own choice
    try:
        everyones = [frozenset(c) for c in local.allgather(sorted(mine))]
    except Exception:  # noqa: BLE001 - an MPI error at start (a lost rank under ULFM):
        everyones = [mine] * local.Get_size()   # assume the node's ranks share my cores;
        # the next collective meets the failure where recovery handles it
    if user_set or choice == "tf":
        return None
    threads = choice if isinstance(choice, int) else share_of(mine, everyones)
    _set_marked(TF_INTRA_OP_VAR, THREADS_MARK_VAR, str(threads))
    log.debug("matex: %s=%d (%d cores, %d ranks on this node)", TF_INTRA_OP_VAR, threads,
              len(mine), len(everyones))
    return threads


def set_mpi_wait_policy() -> str | None:
    """Make a rank that waits in MPI yield its core (Open MPI's ``mpi_yield_when_idle``),
    before MPI starts; returns the value now in force, or None when it is the user's or
    Open MPI's default.

    Open MPI busy-polls by default unless the node is oversubscribed. A rank
    waiting for its peer then burns a core the peer's computation (its
    TensorFlow threads, MaTEx's progress thread) may need: measured in
    ``benchmarks/cpu_defaults.py``. ``MATEX_MPI_WAIT=poll`` keeps Open MPI's
    busy polling; a ``OMPI_MCA_mpi_yield_when_idle`` of the user's (or
    ``--mca mpi_yield_when_idle``) wins. Effective only if MPI has not started
    yet in this process. Processes started from this one inherit the variable,
    marked as MaTEx's (``MATEX_MPI_WAIT_SET``) so that their own choice still
    applies.
    """
    if _users(YIELD_VAR, SET_WAIT_VAR):
        return None
    if _config.mpi_wait() == "poll":
        os.environ.pop(YIELD_VAR, None)
        os.environ.pop(SET_WAIT_VAR, None)
        return None
    _set_marked(YIELD_VAR, SET_WAIT_VAR, "1")
    return "1"


def set_mpi_transports() -> str | None:
    """On one node, leave Open MPI's libfabric byte transport out (``OMPI_MCA_btl=^ofi``),
    before MPI starts; returns the value now in force, or None when it is the user's or
    Open MPI's default.

    Open MPI opens its ``ofi`` BTL at ``MPI_Init`` and, finding no fabric a node's
    own ranks need (shared memory carries every message between them), closes it
    again after a one-second sleep: 1.15 s of each rank's start against 0.14 s
    without it (``import mpi4py.MPI``, the embedded Open MPI 5.0, this project's
    2-core machine). Only on one node: across nodes Open MPI chooses as it would.
    ``OMPI_MCA_btl`` set by the user (or ``--mca btl``) wins. Ignored by other MPIs.
    """
    if _users(BTL_VAR, SET_BTL_VAR):
        return None
    if not _config.launched_on_one_node():
        if os.environ.get(BTL_VAR):    # inherited from a MaTEx process on one node
            os.environ.pop(BTL_VAR, None)
            os.environ.pop(SET_BTL_VAR, None)
        return None
    _set_marked(BTL_VAR, SET_BTL_VAR, ONE_NODE_BTL)
    return ONE_NODE_BTL
