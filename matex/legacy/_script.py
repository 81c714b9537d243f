"""Unmodified TF1 Session scripts under ``python -m matex`` / ``matexrun`` (without --horovod).

Every rank runs the whole script, builds the same graph and feeds the same
global batches (``matex._transparent`` seeds NumPy and TensorFlow alike on
every rank). Installed when TensorFlow is imported, this makes such a script
train one model:

- gradients: every ``tf.compat.v1.train.Optimizer`` (any subclass, also
  under ``minimize``) reduces the gradients of ``compute_gradients``; a
  gradient handed to ``apply_gradients`` that no reduction produced (the
  script's own ``tf.gradients``) is reduced there. The reduction is a
  rows-weighted sum: each rank's gradient times ``rows / batch rows``.
- feeds: in a ``Session.run`` that reaches a reduced gradient (a training
  run), every fed array whose placeholder has an unknown first dimension is
  cut by rows: rank r of N keeps rows [r*B//N, (r+1)*B//N) of the B fed, and
  its weight is its share of the rows. With a loss that is a mean over the
  batch's rows this is exactly the one-process gradient of the whole batch.
  A rank left with no row computes on one row with weight 0. Other runs
  (evaluation, prediction) are left alone: every rank computes all of it.
  No fed array (an input pipeline in the graph): each rank computes the whole
  batch and the average equals it.
- variables: after a ``Session.run`` that runs variables' initialisers
  (``global_variables_initializer()``, a ``MonitoredTrainingSession``'s
  scaffold), rank 0's values of those variables are loaded on every rank.

What cannot be split correctly stops every rank with one error saying what
to change (feeds of different row counts in one training run).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from matex import _state
from matex.legacy import _optimizer_v1, _schedule, _session

HOOK = "matex.legacy.script"
_WEIGHT = "matex_row_weight"

_now = _state.namespace("legacy.script", installed=False)
_busy = _state.local("legacy.script.busy")   # inside this module's own runs
# graph -> weight input. Process state: the graph's reductions hold this placeholder, and a
# run feeds this rank's share to it only when it is here (made again, it would be another)
_weights = _state.weak_table("legacy.script.weights", lifetime="process")
# graph -> {key: plan}; a missing plan is made again from the graph
_plans = _state.weak_table("legacy.script.plans")


class ScriptShapeError(RuntimeError):
    """A TF1 script shape MaTEx cannot distribute correctly (raised on every rank)."""


def _size_rank() -> tuple[int, int]:
    from matex import _runtime

    return _runtime.size(), _runtime.rank()


# ---- gradients ----------------------------------------------------------------

def _row_weight(graph: tf.Graph) -> tf.Tensor:
    """This graph's weight input: this rank's share of the rows (fed per training run)."""
    weight = _weights.get(graph)
    if weight is None:
        size, _ = _size_rank()
        with graph.as_default(), graph.control_dependencies(None), graph.name_scope(None):
            weight = tf.compat.v1.placeholder_with_default(
                tf.constant(1.0 / size, tf.float32), [], name=_WEIGHT)
        _weights[graph] = weight
    return weight


def _weighted_sum(grads: list, variables: list) -> list:
    from matex.compression import _reduce

    weight = _row_weight(tf.compat.v1.get_default_graph())
    return _reduce.reduce_gradients(grads, variables, None, "sum", weight=weight)


def _reaches(ops: list, targets: set) -> bool:
    """Whether any of ``ops`` is, or runs after, an op in ``targets``."""
    seen: set = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op in targets:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False


def _graph_mode() -> bool:
    return not tf.executing_eagerly() and not tf.inside_function()


def _compute_gradients(original):
    def compute_gradients(self, *args, **kwargs):
        pairs = original(self, *args, **kwargs)
        if not _graph_mode() or _optimizer_v1.reducing.get():
            return pairs
        return _optimizer_v1.reduce_pairs(pairs, _weighted_sum)

    return compute_gradients


def _apply_gradients(original):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        if _graph_mode() and not _optimizer_v1.reducing.get():
            reduced = set(_optimizer_v1.reduced_ops(tf.compat.v1.get_default_graph()))
            flat = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in pairs]
            todo = [i for i, g in enumerate(flat)
                    if isinstance(g, tf.Tensor) and not _reaches([g.op], reduced)]
            if todo:   # the script's own gradients (tf.gradients): reduce them here
                done = _optimizer_v1.reduce_pairs([pairs[i] for i in todo], _weighted_sum)
                for i, pair in zip(todo, done):
                    pairs[i] = pair
        return original(self, pairs, *args, **kwargs)

    return apply_gradients


# ---- Session.run ----------------------------------------------------------------

class _Plan:
    __slots__ = ("trains", "initialized")

    def __init__(self, trains: bool, initialized: list) -> None:
        self.trains, self.initialized = trains, initialized


def _fetched_ops(graph: tf.Graph, fetches: Any) -> list:
    ops = []
    for item in _schedule._flat(fetches):
        if isinstance(item, (str, tf.Tensor, tf.Operation, tf.Variable)):
            try:
                element = graph.as_graph_element(item)
            except (TypeError, ValueError, KeyError):
                continue
            ops.append(element if isinstance(element, tf.Operation) else element.op)
    return ops


def _plan(graph: tf.Graph, fetches: Any) -> _Plan:
    ops = _fetched_ops(graph, fetches)
    key = (graph.version, tuple(sorted(op.name for op in ops)))
    plans = _plans.setdefault(graph, {})
    plan = plans.get(key)
    if plan is None:
        reduced = set(_optimizer_v1.reduced_ops(graph))
        trains = bool(reduced) and _reaches(ops, reduced)
        if len(plans) >= 512:   # a loop that adds ops every step changes the key each time
            plans.clear()
        plan = plans[key] = _Plan(trains, _initialized(graph, ops))
    return plan


def _initialized(graph: tf.Graph, ops: list) -> list:
    """The global variables whose initialisers ``ops`` run (through groups of them)."""
    by_initializer = {v.initializer: v for v in
                      graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                      if getattr(v, "initializer", None) is not None}
    found, seen, stack = [], set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op in by_initializer:
            found.append(by_initializer[op])
        elif op.type == "NoOp":   # tf.group(...): its members are control inputs
            stack.extend(op.control_inputs)
    # the same order on every rank (a NoOp's control inputs come in no fixed order)
    return sorted(found, key=lambda v: v.name)


def _rows_fed(graph: tf.Graph, feed_dict: dict) -> dict:
    """The fed arrays to cut by rows: key -> NumPy array."""
    out = {}
    for key, value in feed_dict.items():
        try:
            tensor = graph.as_graph_element(key) if not isinstance(key, tf.Tensor) else key
        except (TypeError, ValueError, KeyError):
            continue
        if not isinstance(tensor, tf.Tensor):
            continue
        shape = tensor.shape
        if shape.rank is not None and (shape.rank == 0 or shape[0] is not None):
            continue
        array = np.asarray(value)
        if array.ndim >= 1:
            out[key] = array
    return out


def _split_feeds(graph: tf.Graph, feed_dict: dict) -> dict:
    """``feed_dict`` with this rank's rows of every per-row array and its weight fed."""
    weight = _weights.get(graph)
    rows = _rows_fed(graph, feed_dict) if weight is not None else None
    if not rows:   # nothing fed by rows, or only a Horovod optimizer's reduction in the graph
        return feed_dict
    counts = {len(a) for a in rows.values()}
    if len(counts) != 1:
        raise ScriptShapeError(
            "matex: cannot split this training Session.run's feed_dict into rows: the "
            "placeholders with an unknown first dimension are fed different row counts (%s). "
            "MaTEx gives each rank its rows of the fed batch. Feed every per-example "
            "placeholder the same number of rows, and give the others a static first "
            "dimension (shape=[k, ...])."
            % ", ".join("%s: %d" % (getattr(k, "name", k), len(a)) for k, a in rows.items()))
    total = counts.pop()
    size, rank = _size_rank()
    lo, hi = rank * total // size, (rank + 1) * total // size
    share = (hi - lo) / total if total else 0.0
    if hi == lo:   # fewer rows than ranks: one row, counted zero times
        lo, hi = 0, min(1, total)
    fed = dict(feed_dict)
    for key, array in rows.items():
        fed[key] = array[lo:hi]
    fed[weight] = np.float32(share)
    return fed


def _broadcast_initialized(run, variables: list) -> None:
    """Load rank 0's values of ``variables`` on every rank."""
    from matex import _runtime

    values = run(variables, None, None, None) if _runtime.rank() == 0 else None
    values = _runtime.control().bcast(values, root=0)
    if _runtime.rank() != 0:
        feeds = {v.initializer.inputs[1]: value for v, value in zip(variables, values)}
        run([v.initializer for v in variables], feeds, None, None)


def _hook(run, session, fetches, feed_dict, options, run_metadata):
    if getattr(_busy, "on", False):
        return run(fetches, feed_dict, options, run_metadata)
    _busy.on = True
    try:
        plan = _plan(session.graph, fetches)
        if plan.trains and feed_dict:
            feed_dict = _split_feeds(session.graph, feed_dict)
        result = run(fetches, feed_dict, options, run_metadata)
        if plan.initialized:
            _broadcast_initialized(run, plan.initialized)
        return result
    finally:
        _busy.on = False


def install() -> None:
    """Distribute unmodified TF1 Session scripts (idempotent; several ranks only)."""
    if _now.installed:
        return
    from matex import _runtime

    _runtime.init()
    if _runtime.size() == 1:
        return
    base = tf.compat.v1.train.Optimizer
    base.compute_gradients = _compute_gradients(base.compute_gradients)
    base.apply_gradients = _apply_gradients(base.apply_gradients)
    _session.add_run_hook(HOOK, _hook)
    _now.installed = True


# ---- --ft (ULFM) --------------------------------------------------------------

FT_HOOK = "matex.legacy.ft"


class RankLostInSession(RuntimeError):
    """A rank was lost while a TF1 ``Session.run`` was communicating (not recovered)."""


def _lost_a_rank(exc: BaseException) -> bool:
    from matex import _resilience

    if _resilience.is_failure(exc):   # also the scheduler's agreement (an MPI.Exception)
        return True
    # a TF1 Session drops the op's MPI payload: ask the communicators instead
    return isinstance(exc, tf.errors.OpError) and _resilience.failure_known()


def _ft_hook(run, session, fetches, feed_dict, options, run_metadata):
    try:
        return run(fetches, feed_dict, options, run_metadata)
    except Exception as exc:
        if not _lost_a_rank(exc):
            raise
        raise RankLostInSession(
            "matex --ft: a rank was lost during a TF1 Session.run. MaTEx does not recover "
            "TF1 Session scripts (a Session's variables cannot be rolled back to the last "
            "step every rank completed): every rank stops here. Save checkpoints "
            "(tf.compat.v1.train.Saver) and relaunch from the last one, e.g. with matexrun "
            "--restart N; Keras fit and matex.run_resilient loops do recover under --ft."
        ) from exc


def install_ft() -> None:
    """Under ``--ft`` with ULFM: a rank lost inside a TF1 ``Session.run`` ends every rank
    with one clear error (``RankLostInSession``), never a hang."""
    from matex import _resilience

    if _resilience.mode() == "ulfm":
        _session.add_run_hook(FT_HOOK, _ft_hook)   # outside the scheduler (innermost)
