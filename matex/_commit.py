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
"""

from typing import Callable, Iterable, TypeVar

import tensorflow as tf

from matex import _collectives

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
