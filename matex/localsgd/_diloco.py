"""DiLoCo: local steps by an inner optimizer, an outer step on the averaged pseudo-gradient.

``DiLoCo(inner, outer, sync_every=H)`` (Douillard et al., 2023): every rank
takes H steps with ``inner`` on its own data, as in Local SGD. Then the
pseudo-gradient ``anchor - weights`` (the anchor being the weights at the
last synchronisation) is averaged over ranks, ``outer`` applies it to the
anchor (the paper's outer optimizer is Nesterov SGD, e.g.
``keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)``) and every rank
continues from the new anchor. With ``outer = SGD(1.0)`` (no momentum) the
new anchor is the average of the weights: Local SGD, up to float rounding.

The anchor (one copy of the trainable weights) and the outer optimizer's
state are the same on every rank; the inner optimizer's slots stay local.
Neither belongs to the inner optimizer's variables, so a saved model and its
optimizer look as without DiLoCo. Fault tolerance as Local SGD: roll back to
the last synchronisation, anchor and outer state included.
"""

import keras
import tensorflow as tf

from matex import _recovery
from matex.localsgd._local_sgd import LocalStrategy, convert


class DiLoCoStrategy(LocalStrategy):
    """Local steps, then an outer step on the averaged pseudo-gradient (see the module doc)."""

    name = "DiLoCo"

    def __init__(self, outer, sync_every):
        super().__init__(sync_every)
        self.outer = outer
        self.anchors = None    # keras.Variables: the weights at the last synchronisation
        self.anchored = None   # int32 variable: 1 once the anchors hold the first weights

    def own_variables(self):
        if self.anchors is None:
            return []
        return list(self.anchors) + list(self.outer.variables) + [self.anchored]

    def _build(self, variables):
        with tf.init_scope():
            ready = all(_recovery.has_value(v) for v in variables)
            self.anchors = [
                keras.Variable(tf.convert_to_tensor(v) if ready else tf.zeros(v.shape, v.dtype),
                               trainable=False, name="diloco_anchor_%d" % i)
                for i, v in enumerate(variables)]
            self.anchored = tf.Variable(1 if ready else 0, dtype=tf.int32, trainable=False,
                                        name="diloco_anchored")
            self.outer.build(self.anchors)

    def before_update(self, optimizer, variables):
        if self.anchors is None:
            self._build(variables)
        if len(self.anchors) != len(variables):
            raise ValueError("DiLoCo: %d variables to update, %d at the first step; the "
                             "variables must stay the same" % (len(variables),
                                                               len(self.anchors)))

        def anchor():   # weights created inside the trace: anchor them at the first run
            for a, v in zip(self.anchors, variables):
                a.assign(v)
            self.anchored.assign(1)
            return tf.constant(True)

        if tf.executing_eagerly():
            return [] if int(self.anchored) else [anchor()]
        return [tf.cond(tf.equal(self.anchored, 0), anchor, lambda: tf.constant(False))]

    def synchronise(self, optimizer, variables):
        deltas = [tf.convert_to_tensor(a) - tf.convert_to_tensor(v)
                  for a, v in zip(self.anchors, variables)]
        averaged = self.average(deltas)   # weighted by rows since the last sync
        with tf.control_dependencies([a for a in averaged]):   # all or nothing
            self.outer.apply(averaged, self.anchors)
            # after the outer update (same resources: ordered), every rank restarts there
            for v, a in zip(variables, self.anchors):
                v.assign(a)
        return tf.constant(True)


def DiLoCo(inner_optimizer: keras.optimizers.Optimizer | str,
           outer_optimizer: keras.optimizers.Optimizer | str,
           sync_every: int) -> keras.optimizers.Optimizer:
    """DiLoCo: H local steps with ``inner_optimizer``, then an outer step on the average.

    Args:
      inner_optimizer: the Keras 3 optimizer of the local steps (instance,
        class or name; converted in place and returned, slots stay local).
      outer_optimizer: a Keras 3 optimizer instance applied, every
        ``sync_every`` steps, to the weights at the last synchronisation with
        the pseudo-gradient ``(weights at last sync - current weights)``
        averaged over ranks; e.g. ``keras.optimizers.SGD(0.7, momentum=0.9,
        nesterov=True)``. Used by this wrapper alone (never reduced again).
      sync_every: local steps between two outer steps (H >= 1).
    Returns:
      The inner optimizer, to pass to ``model.compile`` or to call in a custom
      loop (as ``LocalSGD``).
    Raises:
      ValueError: ``sync_every`` is not an integer >= 1; TypeError: the outer
      optimizer is not a Keras optimizer instance.
    """
    if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
        raise TypeError("DiLoCo needs a Keras 3 optimizer instance as outer optimizer, got %r"
                        % (outer_optimizer,))
    if outer_optimizer is inner_optimizer:
        raise ValueError("DiLoCo needs two distinct optimizers (inner and outer)")
    strategy = DiLoCoStrategy(outer_optimizer, sync_every)
    # the outer optimizer's apply must stay as it is (matex.keras would make it distributed)
    object.__setattr__(outer_optimizer, "_matex_reduced_by_wrapper", True)
    return convert(inner_optimizer, strategy)
