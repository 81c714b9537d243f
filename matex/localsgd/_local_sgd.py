"""Local SGD: every rank steps alone; the weights are averaged every ``sync_every`` steps.

``LocalSGD(optimizer, sync_every=H)`` turns a Keras optimizer into one whose
``apply`` updates this rank's weights with this rank's own gradient (no
communication) and, after every H-th update (``optimizer.iterations`` a
multiple of H), replaces the weights by their average over ranks (one fused
allreduce of the weights, the same buckets as the gradients of data
parallelism). H steps cost one synchronisation instead of H.

Where ``fit`` divides a global batch unevenly (the last batch of an epoch),
the average is weighted by the rows each rank trained on since the last
synchronisation (``LocalStrategy.average``), so no rank's data counts more
than another's. Optimizer slots (momentum, Adam's moments) stay local: each rank keeps its
own, as torchft's LocalSGD and DiLoCo do; only the trainable weights are
averaged. The step counter is the same on every rank (every rank steps).
The first step starts from rank 0's weights and optimizer state, as with
``DistributedOptimizer``. With H = 1 and plain SGD (or momentum) it is data
parallelism up to float rounding (the average of the updated weights instead
of the update by the averaged gradient).

Rank failure under ULFM (``matexrun --ft``): the recovery loop's
``RollbackState`` puts every survivor back to the last synchronisation point
(weights, optimizer state, step counter and the model's other variables, as
they were when the step after that synchronisation began), takes the new
rank 0's values, and training redoes the steps since, re-divided among the
survivors: at most H - 1 steps of work are redone and no sample is lost or
counted twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from matex import _collectives, _commit, _compat, _fusion, _optimizer, _recovery, _stats
from matex.compression._reduce import _name

if TYPE_CHECKING:
    import keras


def check_sync_every(sync_every):
    """``sync_every`` as an int >= 1, or a ValueError that says what it must be."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError("sync_every must be an integer >= 1 (the number of local steps "
                         "between two synchronisations), not %r" % (sync_every,))
    return sync_every


def _cond(pred, true_fn):
    """Run ``true_fn`` when ``pred``, as a commit (``_commit``): an ``if`` eagerly; in a
    graph a tf.cond after the graph's last collective, every later collective after it.

    The collectives inside a cond are ordered explicitly that way, and the
    synchronisation it holds (the average, then the assignments) is
    all-or-nothing like any other update.
    """
    if tf.executing_eagerly():
        return true_fn() if bool(pred) else tf.constant(False)
    last = _optimizer._last_collectives(tf.compat.v1.get_default_graph())
    return _commit.commit(lambda: tf.cond(pred, true_fn, lambda: tf.constant(False)), after=last)


class LocalStrategy:
    """How a LocalSGD optimizer applies gradients (``_optimizer._State.strategy``)."""

    # fit under matex.keras / python -m matex still slices the data: this says
    # how ranks synchronise, not who shards
    leaves_data_to_fit = True
    name = "LocalSGD"

    def __init__(self, sync_every):
        self.sync_every = check_sync_every(sync_every)
        self.syncs = 0   # synchronisations traced (graph) or run (eager); for tests
        self.rows = None   # float64 variable: this rank's rows since the last sync, once known

    def own_variables(self):
        """Variables this strategy keeps besides the model's and the optimizer's."""
        return []

    def before_update(self, optimizer, variables):
        """Hook before the local update (DiLoCo records its anchor)."""
        return []

    def average(self, values):
        """The average over ranks of ``values`` (one tensor per variable), weighted by the
        rows each rank trained on since the last synchronisation when they are known.

        ``fit`` under MaTEx divides a global batch that does not divide evenly
        into uneven slices (the last batch of an epoch; 0 rows on some ranks):
        a rank's weights then carry less data than another's, and the plain
        mean would count them alike. With H = 1 and SGD the weighted mean of
        the updated weights is data parallelism's update by the global-batch
        gradient. Unknown rows (a custom loop without ``rows_of_step``): the
        plain mean. The row count restarts at every synchronisation.
        """
        if self.rows is None:
            return _fusion.allreduce_gradients(values, "average")
        mine = tf.convert_to_tensor(self.rows)
        total = _collectives.allreduce(mine, "sum")
        share = tf.math.divide_no_nan(mine, total)
        weighted = [v * tf.cast(share, v.dtype) for v in values]
        summed = _fusion.allreduce_gradients(weighted, "sum")
        with tf.control_dependencies(summed):
            reset = self.rows.assign(tf.zeros_like(mine))
        with tf.control_dependencies([reset]):
            return [tf.identity(s) for s in summed]

    def synchronise(self, optimizer, variables):
        """Replace the weights by their (row-weighted) average over ranks."""
        values = [tf.convert_to_tensor(v) for v in variables]
        averaged = self.average(values)
        with tf.control_dependencies([a for a in averaged]):   # all or nothing
            for v, a in zip(variables, averaged):
                v.assign(a)
        return tf.constant(True)

    def _count_rows(self, rows):
        """Add this step's rows to the count since the last synchronisation (op)."""
        if rows is None:
            return []
        if self.rows is None:
            with tf.init_scope():
                self.rows = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                        name="matex_local_rows")
        return [self.rows.assign_add(tf.cast(rows, tf.float64))]

    def restart_rows(self):
        """Back at a synchronisation point (a rollback): no rows trained since (local)."""
        if self.rows is not None:
            self.rows.assign(0.0)

    def apply(self, optimizer, grads, variables, inner_apply, op, rows):
        variables = list(variables if variables is not None
                         else _compat.optimizer_trainable_variables(optimizer))
        deps = self.before_update(optimizer, variables) + self._count_rows(
            rows if op == "average" else None)
        with tf.control_dependencies(deps):
            inner_apply(grads, variables)
        # read after the update (same resource: ordered), so the count includes this step
        due = tf.equal(tf.math.floormod(tf.convert_to_tensor(optimizer.iterations),
                                        self.sync_every), 0)
        self.syncs += 1
        self._count_bytes(variables, due)
        return _cond(due, lambda: self.synchronise(optimizer, variables))

    def _count_bytes(self, variables, due):
        """``matex.stats()``: a synchronisation sends every trainable variable whole (the
        weights, or DiLoCo's pseudo-gradient of the same shape), other steps nothing;
        "dense" is what data parallelism would send every step (each gradient)."""
        sizes = [v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in variables]
        sent = [tf.where(due, tf.constant(n, tf.int64), tf.constant(0, tf.int64))
                for n in sizes]
        _stats.record([_name(None, variables, i) for i in range(len(variables))], sent, sizes)

    def recovery_state(self, optimizer, variables) -> "RollbackState":
        """Its step state (joined to the optimizer by ``convert``): the rollback point."""
        return RollbackState(self, optimizer, variables)


class RollbackState(_recovery.State):
    """Roll back to the last synchronisation point after a rank failure.

    ``begin_step`` (called by the recovery loop's callers before every step)
    snapshots ``variables()`` (the model's and the optimizer's, step counter
    included) and the strategy's own variables when the step counter is a
    multiple of H, i.e. right after a synchronisation; ``restore`` puts them
    back; ``sync`` (after the model state took the new rank 0's values) takes
    rank 0's own variables and snapshots the agreed state again.
    """

    def __init__(self, strategy, optimizer, variables):
        self.strategy, self.optimizer, self.variables = strategy, optimizer, variables
        self.at, self.saved = None, None

    def _all(self):
        return list(self.variables()) + list(self.strategy.own_variables())

    def begin_step(self):
        step = int(self.optimizer.iterations)
        if step % self.strategy.sync_every == 0 and step != self.at:
            self.saved = _recovery._snapshot(self._all())
            self.at = step

    def restore(self):
        self.strategy.restart_rows()
        if self.saved is None:
            return
        everything = self._all()
        if len(everything) != len(self.saved):
            raise RuntimeError("matex: cannot roll back to the last synchronisation: the "
                               "variables changed since (%d now, %d saved)"
                               % (len(everything), len(self.saved)))
        for v, value in zip(everything, self.saved):
            v.assign(value)

    def sync(self, root=0):
        _collectives.broadcast_variables(list(self.strategy.own_variables()), root)
        self.at = None
        self.begin_step()   # everyone now holds the root's synchronised state

    def arrays(self):
        return [tf.convert_to_tensor(v).numpy() for v in self.strategy.own_variables()]


def convert(optimizer, strategy):
    """Make ``optimizer`` distributed (in place) with ``strategy`` as its update rule."""
    optimizer = _optimizer.DistributedOptimizer(optimizer)
    current = optimizer._matex.strategy
    if current is not None:
        raise ValueError("this optimizer already has a synchronisation rule (%s); wrap a "
                         "fresh optimizer" % type(current).__name__)
    if optimizer._matex.compression is not None:
        raise ValueError("%s sends the weights uncompressed, and the optimizer compresses "
                         "with %r (compression=, or MATEX_COMPRESSION); unset it or use "
                         "data parallelism with compression"
                         % (strategy.name, optimizer._matex.compression))
    optimizer._matex.strategy = strategy
    _recovery.join(optimizer, "rollback", strategy.recovery_state)   # its rollback point
    return optimizer


def LocalSGD(optimizer: keras.optimizers.Optimizer | str,
             sync_every: int) -> keras.optimizers.Optimizer:
    """Local SGD: step alone, average the weights over ranks every ``sync_every`` steps.

    Args:
      optimizer: a Keras 3 optimizer (instance, class or name), converted in
        place like ``DistributedOptimizer`` and returned.
      sync_every: local steps between two weight averagings (H >= 1). Slots
        (momentum, Adam moments) stay local.
    Returns:
      The optimizer: pass it to ``model.compile`` (``fit`` under
      ``matex.keras``/``python -m matex`` still slices each global batch among
      the ranks) or call ``apply``/``apply_gradients`` in a custom loop (give
      each rank its own data, e.g. ``matex.shard``).
    Raises:
      ValueError: ``sync_every`` is not an integer >= 1.

    Example:
      >>> model.compile(optimizer=matex.LocalSGD(keras.optimizers.SGD(0.1), sync_every=8),
      ...               loss="sparse_categorical_crossentropy")
    """
    return convert(optimizer, LocalStrategy(sync_every))
