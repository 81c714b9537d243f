"""The commit point: where a step's update is made all-or-nothing.

A training step first reduces over ranks (the gradients, a delayed average,
the weights of a Local SGD synchronisation) and then updates variables.
Under ULFM a peer can die inside any collective, and the errors are not
uniform: some survivors finish a collective that others see fail. The
recovery loop (``matex._recovery``) can put a step right only if, on every
rank, its update either happened entirely or not at all (the optimizer's
step counter then says which). ``commit(update, after)`` builds the update
that way:

* every op ``update()`` creates is created under a control dependency on
  ``after`` (what the step reduced): no variable changes before every
  reduction it needs succeeded on this rank;
* the whole update, all of those ops, becomes the graph's barrier
  (``_collectives.set_barrier``): every collective created later waits for
  it, so a later collective that fails can never interrupt it halfway.

Every op of the update is captured, not only those that read ``after``:
Keras increments ``optimizer.iterations`` with no data dependency on the
gradients, and that increment is the commit itself. Eagerly ops run in
Python order; ``update()`` just runs.

The one place this rule lives: ``DistributedOptimizer`` (data parallelism),
``delay=1`` (``_delayed``) and Local SGD/DiLoCo's synchronisation
(``localsgd``) all commit through it. Horovod's ``State.commit()`` and
torchft's ``Manager.should_commit()`` are the prior art.

The vote: where a step's rows count rides in the gradients' fused allreduce
(``fit``'s step, ``_optimizer._weighted_average``), each rank's vote rides
with it: ``votes_against(grads)`` is 1 on a rank whose own gradients hold a
NaN or an infinity (a corrupt sample in its shard, an overflow), else 0. The
summed votes are the same number on every rank, so ``if_voted`` makes one
decision everywhere with no collective of its own: with any vote against,
no rank applies the update (weights, optimizer state and step counter stay
as they were), and the rank that voted against says so on its stderr. The
skipped steps in a row are counted; at ``MATEX_SKIP_LIMIT`` every rank raises
the same error at the same step, so a loop can never skip without end.

A custom loop votes explicitly: ``should_commit(ok)`` is one collective
decision that folds in whatever this rank saw go wrong, the same on every rank.
"""

import sys
from typing import Callable, Iterable, TypeVar

import tensorflow as tf

from matex import _collectives, _config

T = TypeVar("T")


def commit(update: Callable[[], T], after: Iterable = ()) -> T:
    """Build ``update()`` as the step's commit; returns what it returns.

    Args:
      update: creates the update's ops (variable assignments, the step
        counter's increment, a ``tf.cond`` holding a synchronisation).
      after: tensors or ops that must exist before any of them runs (the
        reduced gradients; the graph's last collective). ``None`` entries
        are skipped.
    """
    if tf.executing_eagerly():
        return update()
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    with tf.control_dependencies([a for a in after if a is not None]):
        result = update()
    created = graph.get_operations()[first:]
    if created:
        _collectives.set_barrier(tf.group(*created))
    return result


def votes_against(grads: Iterable, dtype: tf.DType) -> tf.Tensor:
    """This rank's vote against committing the step: 1 when one of its own gradients
    holds a NaN or an infinity, else 0 (as ``dtype``, to ride in the fused allreduce).

    One sum per gradient, not an elementwise test: a NaN or an infinity anywhere
    makes the sum non-finite."""
    sums = [tf.cast(tf.reduce_sum(g.values if isinstance(g, tf.IndexedSlices) else g),
                    tf.float64) for g in grads if g is not None]
    if not sums:
        return tf.zeros([], dtype)
    return tf.cast(tf.logical_not(tf.math.is_finite(tf.add_n(sums))), dtype)


def if_voted(against: tf.Tensor, mine: tf.Tensor, update: Callable[[], object],
             skipped: tf.Variable, step: tf.Variable) -> tf.Tensor:
    """Run ``update()`` when no rank voted against (``against``: the summed votes, the
    same on every rank; ``mine``: this rank's own vote). Returns whether it ran.

    ``skipped`` counts the refused steps in a row (reset by a committed one); when it
    reaches ``MATEX_SKIP_LIMIT`` the step raises ``InvalidArgumentError`` on every rank.
    ``step``: the step counter, named in the messages."""
    limit = _config.skip_limit()
    agreed = tf.equal(against, tf.zeros_like(against))

    def commit_it():
        update()
        return tf.constant(True)

    def say():
        printed = tf.print("matex: this rank's gradients hold a NaN or an infinity at step",
                           step, "- the step is not committed on any rank",
                           output_stream=sys.stderr)
        with tf.control_dependencies([printed] if printed is not None else []):
            return tf.constant(True)

    def refuse():
        warn = tf.cond(tf.greater(mine, tf.zeros_like(mine)), say, lambda: tf.constant(False))
        with tf.control_dependencies([warn]):
            return tf.constant(False)

    done = tf.cond(agreed, commit_it, refuse)
    count = skipped.assign(tf.where(done, tf.zeros_like(skipped), skipped + 1))
    check = tf.debugging.Assert(
        tf.less(count, limit),
        ["matex: the last", count, "steps were not committed: at step", step,
         "ranks' gradients held a NaN or an infinity (votes against:", against,
         "). Every rank stops here; look for corrupt samples or a diverging loss, or "
         "raise MATEX_SKIP_LIMIT (now %d)" % limit])
    with tf.control_dependencies([check]):
        return tf.identity(done)


def should_commit(ok: bool = True) -> bool:
    """One vote on the step, the same answer on every rank: True when every rank says ``ok``.

    For a custom loop's local errors (a batch this rank failed to read, a check that
    failed here), so that every rank takes the same branch::

        ok = batch is not None and bool(tf.reduce_all(tf.math.is_finite(loss)))
        if matex.should_commit(ok):
            optimizer.apply(grads, model.trainable_variables)

    Collective (every rank must call it). Under ULFM it is MPI's fault-tolerant
    agreement (``MPI_Comm_agree``): a rank lost during the vote is reported alike on
    every survivor, as a rank failure that ``matex.run_resilient`` recovers from.
    Otherwise a logical AND over MaTEx's control communicator. One rank: ``ok``.
    """
    from mpi4py import MPI

    from matex import _resilience, _runtime

    comm = _runtime.control()
    if _resilience.mode() == "ulfm":
        return bool(comm.Agree(int(bool(ok))))
    return bool(comm.allreduce(bool(ok), op=MPI.LAND))
