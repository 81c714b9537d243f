"""The graph-collective scheduler: one order for the MaTEx collectives of each TF1 ``Session.run``.

A TF1 graph's collectives depend on nothing but their inputs: a
``Session.run`` executes exactly the collectives its fetches need (a broadcast
fetched alone after the initialiser runs alone, with nothing fed). TensorFlow's
executor may start independent ones in any order, a different one per rank,
which would pair one rank's tensor with another's. So, around each
``Session.run`` (a hook of ``matex.legacy._session``):

1. the *plan*: the numbered MaTEx collectives (``_matex_seq``, set when
   ``matex._collectives`` makes them) that the run will execute, found by
   walking back from the fetches through inputs and control inputs, stopping
   at fed tensors, exactly as TensorFlow prunes the graph. They are put in a
   topological order (an op after the collectives it depends on), ties broken
   by creation number then name: the same on every rank that built the same
   graph. Cached per graph, fetches and fed keys.
2. the *agreement*: one small allreduce on MaTEx's control communicator of a
   digest of that order (only when the run has collectives on the data
   communicator). Ranks that fetch different collectives get one clear error,
   on every rank, before any collective starts: never a hang inside the run
   and never a silent wrong pairing.
3. the *turnstile* (C++, ``tf_ops/core/turnstile.cc``): the kernels run in
   that order. A kernel whose turn has not come is queued, not blocked, so
   the executor's threads never wait on it.

Collectives in control flow. A MaTEx collective cannot be made inside a v1
``tf.compat.v1.cond``/``while_loop`` (it would run 0 or many times, which no
rank can know before the run): making one raises at graph construction. One
inside a function (control flow v2, a ``tf.function`` called in the graph)
runs in that function's program order; a run that reaches such a function and
any other MaTEx collective cannot be ordered and raises before running (the
same decision on every rank). ``Session.make_callable`` and ``partial_run``
do not pass through ``Session.run``: their collectives run unscheduled.
"""

from __future__ import annotations

import hashlib
import heapq
import threading

import tensorflow as tf

from matex import _state
from matex.legacy import _session

HOOK_NAME = "matex.schedule"
SEQ_ATTR = "_matex_seq"
# the kernels that take their turn (tf_ops/kernels: MATEX_REGISTER_GATED)
GATED = frozenset({"MatexAllreduce", "MatexGroupedAllreduce", "MatexBroadcast",
                   "MatexAllgather", "MatexAlltoall", "MatexReducescatter",
                   "MatexSend", "MatexRecv", "MatexSendRecv", "MatexSparseAllreduce"})
_CALLS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
                    "PartitionedCall", "StatefulPartitionedCall"})

_now = _state.namespace("legacy.schedule", installed=False)
_install_lock = threading.Lock()
_run_lock = threading.Lock()   # one scheduled run at a time in this process
# graph -> {(fetch key, feed key): _Plan}; a missing plan is made again from the graph
_plans = _state.weak_table("legacy.schedule.plans")
_MAX_PLANS = 512   # per graph: a loop that builds new fetches every step must not grow it
stats = {"runs": 0, "scheduled": 0, "plans": 0}   # for tests and the benchmark


class _Plan:
    __slots__ = ("order", "digest", "agree", "describe", "error", "mismatch_code", "keep")

    def __init__(self, order=(), digest=0, agree=False, describe="", error=None,
                 mismatch_code=None, keep=None):
        self.order = list(order)          # node names, in turn order
        self.digest = digest              # int63 of the data communicator's part
        self.agree = agree                # some collective on the data communicator
        self.describe = describe          # for the mismatch message
        self.error = error                # raise this instead of running
        self.mismatch_code = mismatch_code
        self.keep = keep                  # the fetch/feed objects the key's ids name


def install() -> None:
    """Put the scheduler around ``Session.run`` (once per process)."""
    if _now.installed:
        return
    with _install_lock:
        if not _now.installed:
            # innermost: it plans the fetches and feeds TensorFlow will actually get
            _session.add_run_hook(HOOK_NAME, _hook, innermost=True)
            _now.installed = True


def _flat(structure):
    try:
        return tf.nest.flatten(structure, expand_composites=True)
    except TypeError:   # a dict whose keys do not sort (MonitoredSession's: its hooks)
        if isinstance(structure, dict):
            return [x for value in structure.values() for x in _flat(value)]
        if isinstance(structure, (list, tuple)):
            return [x for value in structure for x in _flat(value)]
        raise


def _key(fetches, feed_dict):
    flat_fetches = _flat(fetches)
    feeds = list(feed_dict) if feed_dict else []
    key = (tuple(x if isinstance(x, str) else id(x) for x in flat_fetches),
           tuple(x if isinstance(x, str) else id(x) for x in _flat(feeds)))
    return key, (flat_fetches, feeds)


def _hook(run, session, fetches, feed_dict=None, options=None, run_metadata=None):
    graph = session.graph
    plans = _plans.get(graph)
    if plans is None:
        plans = _plans[graph] = {}
    key, keep = _key(fetches, feed_dict)
    plan = plans.get(key)
    if plan is None:
        plan = _make_plan(graph, *keep)
        plan.keep = keep   # the ids in the key stay valid while the plan is cached
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[key] = plan
        stats["plans"] += 1
    stats["runs"] += 1
    if plan.error is not None:
        raise plan.error
    if not plan.order:
        return run(fetches, feed_dict, options, run_metadata)
    from matex import _runtime

    with _run_lock:
        # the communicator handed to the kernels (a graph imported in this process has
        # collectives that no MaTEx call here made), then the agreement
        core = _runtime._core()
        if plan.agree:
            _agree(plan)
        core.begin_graph_run(plan.order)
        try:
            stats["scheduled"] += 1
            return run(fetches, feed_dict, options, run_metadata)
        finally:
            core.end_graph_run()


def _agree(plan):
    """Every rank runs this plan's data-communicator collectives, or every rank raises."""
    import numpy as np
    from mpi4py import MPI

    from matex import _runtime

    comm = _runtime.control()
    if comm.Get_size() == 1:
        return
    v = np.array([plan.digest, -plan.digest], np.int64)
    comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MAX)
    if v[0] == -v[1]:
        return
    described = comm.allgather(plan.describe)
    message = ("ranks fetch different MaTEx collectives in this Session.run (each rank must "
               "run the same collectives of the same graph): " + "; ".join(
                   "rank %d: %s" % (r, d) for r, d in enumerate(described)))
    error = (tf.errors.FailedPreconditionError
             if plan.mismatch_code == tf.errors.FAILED_PRECONDITION   # matex.horovod's code
             else tf.errors.InvalidArgumentError)
    raise error(None, None, message)


def _resolve(graph, element):
    if isinstance(element, (tf.Operation, tf.Tensor)):
        return element
    return graph.as_graph_element(element, allow_tensor=True, allow_operation=True)


def _seq(op):
    if op.type not in GATED:
        return None
    try:
        return op.get_attr(SEQ_ATTR)
    except ValueError:
        return None


def _functions_with_collectives(graph):
    """Names of the graph's library functions that hold (or call one holding) a MaTEx op."""
    library = graph.as_graph_def().library.function
    calls, holds = {}, set()
    for f in library:
        name = f.signature.name
        calls[name] = set()
        for node in f.node_def:
            if node.op.startswith("Matex"):
                holds.add(name)
            calls[name].add(node.op)
            for attr in node.attr.values():
                if attr.HasField("func"):
                    calls[name].add(attr.func.name)
                calls[name].update(fn.name for fn in attr.list.func)
    changed = True
    while changed:
        changed = False
        for name, called in calls.items():
            if name not in holds and called & holds:
                holds.add(name)
                changed = True
    return holds


def _calls_collectives(op, holding):
    for value in op.node_def.attr.values():
        if value.HasField("func") and value.func.name in holding:
            return True
        if any(fn.name in holding for fn in value.list.func):
            return True
    return False


def _make_plan(graph, flat_fetches, feeds):
    try:
        roots = [_resolve(graph, x) for x in flat_fetches]
        fed = {_resolve(graph, k).name for k in _flat(feeds)}
    except (TypeError, ValueError, KeyError):
        return _Plan()   # not ours to judge: TensorFlow's run reports a bad fetch or feed
    roots = [r if isinstance(r, tf.Operation) else r.op for r in roots]
    # post-order walk: the nearest gated ancestors of each op, stopping at fed tensors
    nearest, done, on_path = {}, set(), set()
    gated, calls = {}, []
    stack = [(op, False) for op in roots]
    while stack:
        op, expanded = stack.pop()
        if op in done:
            continue
        children = [t.op for t in op.inputs if t.name not in fed] + list(op.control_inputs)
        if not expanded:
            if op in on_path:
                continue   # a cycle (a v1 while loop): no collective can be inside it
            on_path.add(op)
            stack.append((op, True))
            stack.extend((c, False) for c in children if c not in done)
            continue
        ancestors = set()
        for c in children:
            if c in gated:
                ancestors.add(c)
            else:
                ancestors.update(nearest.get(c, ()))
        seq = _seq(op)
        if seq is not None:
            gated[op] = seq
        elif op.type in _CALLS:
            calls.append(op)
        nearest[op] = frozenset(ancestors)
        on_path.discard(op)
        done.add(op)
    if calls:
        holding = _functions_with_collectives(graph)
        opaque = [c for c in calls if _calls_collectives(c, holding)]
        if opaque and len(opaque) + len(gated) > 1:
            return _Plan(error=tf.errors.UnimplementedError(None, None, (
                "this Session.run reaches MaTEx collectives inside a function or control "
                "flow v2 (%s) and other MaTEx collectives (%d more): their order across "
                "ranks cannot be agreed before the run. Fetch them in separate runs, or "
                "compute the collectives outside the cond/loop/function."
                % (", ".join(sorted(c.name for c in opaque)), len(opaque) + len(gated) - 1))))
    if not gated:
        return _Plan()
    # topological order of the gated ops, ties by (creation number, name)
    waits = {op: nearest[op] for op in gated}   # the gated ops each one waits for directly
    blocked = {op: len(w) for op, w in waits.items()}
    unblocks = {op: [] for op in gated}
    for op, w in waits.items():
        for a in w:
            unblocks[a].append(op)
    heap = [(gated[op], op.name, op) for op, n in blocked.items() if n == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, op = heapq.heappop(heap)
        order.append(op)
        for later in unblocks[op]:
            blocked[later] -= 1
            if blocked[later] == 0:
                heapq.heappush(heap, (gated[later], later.name, later))
    data = [op for op in order if _comm(op) == 0]
    text = "; ".join("%s %s" % (op.type, op.name) for op in data)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                            "little") >> 2
    code = None
    try:
        code = order[0].get_attr("_matex_mismatch_code")
    except ValueError:
        pass
    return _Plan(order=[op.name for op in order], digest=digest, agree=bool(data),
                 describe="%d collectives: %s" % (len(data), text or "none"),
                 mismatch_code=code)


def _comm(op):
    try:
        return op.get_attr("comm")
    except ValueError:
        return 0
