"""The compressor interface, the per-variable policy and the error-feedback memory.

A compressor reduces a group of dense gradients over ranks in fewer bytes
than the dense allreduce. ``reduce(items, op, threshold)`` returns, for each
item, the reduced gradient every rank applies (bitwise equal on all ranks:
only values that came out of a collective, or were computed identically from
them, make it up) and the bytes this rank handed to MPI for it. Which
gradients a compressor takes is ``selects``: by default matrices of at least
``min_size`` elements; biases, norms and small tensors stay on the dense
fused allreduce.

Error feedback (Karimireddy et al. 2019): what a rank did not send this step
(its residual) is added to its next gradient, so nothing is lost for good.
Residuals differ per rank, which is fine: the update applied is the same.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import tensorflow as tf

if TYPE_CHECKING:
    import keras

from matex import _recovery

DEFAULT_MIN_SIZE = 1024   # elements: below this a tensor stays dense (latency, not bytes)


class Item:
    """One gradient to reduce: the tensor, its variable (or None) and a name."""

    def __init__(self, grad, variable, name):
        self.grad = grad
        self.variable = variable
        self.name = name

    @property
    def size(self):
        return self.grad.shape.num_elements()


def check_float(item, what):
    """A clear TypeError for an integer gradient given to a float compressor."""
    if not item.grad.dtype.is_floating:
        raise TypeError("%s compresses float gradients; %s has a %s gradient (leave it out "
                        "with a larger min_size, or use no compression)"
                        % (what, item.name, item.grad.dtype.name))


def check_ratio(ratio, what):
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError("%s ratio must be a number in (0, 1], not %r" % (what, ratio))
    if not 0 < ratio <= 1:
        raise ValueError("%s ratio must be in (0, 1], not %r" % (what, ratio))
    return float(ratio)


def _state_variable(initial, name):
    """A non-trainable tf.Variable made outside any trace (like an optimizer slot);
    ``initial`` is a callable, run there too."""
    with tf.init_scope():
        return tf.Variable(initial(), trainable=False, name=name)


class PerVariable:
    """State kept per gradient (per variable when known), dropped when the variable is freed.

    A compressor made from text (``"topk:0.01"``) is one object per process
    (``_spec.build``), shared by every model a search or a script builds: it
    must not keep those models' variables, nor its state for them, alive.
    """

    def __init__(self):
        self._entries = {}   # state_key -> (weak reference to the variable or None, state)

    def get(self, item, make):
        """The state for ``item``, made by ``make()`` (outside any trace) the first time."""
        key, owner = state_key(item)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not owner:
            if owner is None:
                ref = _no_owner
            else:
                ref = weakref.ref(owner)
                weakref.finalize(owner, self._entries.pop, key, None)
            entry = (ref, _state_variable(make, "matex_" + type(self).__name__.lower()))
            self._entries[key] = entry
        return entry[1]

    def __len__(self):
        return len(self._entries)

    def values(self):
        """Every state variable held now."""
        return [state for _, state in self._entries.values()]


def _no_owner():
    return None


class ErrorFeedback(PerVariable):
    """Per-variable residuals of one compressor (zeros until first written)."""

    def residual(self, item):
        shape, dtype = item.grad.shape, item.grad.dtype
        return self.get(item, lambda: tf.zeros(shape, dtype))


def state_key(item):
    """(dict key, object that must stay the same) for per-variable state: the variable
    itself when known, else the gradient's name."""
    if item.variable is not None:
        return id(item.variable), item.variable
    return "name:" + item.name, None


class Compressor:
    """Base class: policy (which gradients), a step counter, and the interface."""

    name = "compressor"

    def __init__(self, min_size: int = DEFAULT_MIN_SIZE) -> None:
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError("min_size must be a whole number >= 0, not %r" % (min_size,))
        self.min_size = min_size
        self._step = None

    def selects(self, item: Item) -> bool:
        """Whether this compressor takes ``item`` (else it goes dense and fused)."""
        size = item.size
        return size is not None and size >= self.min_size and item.grad.shape.rank >= 2

    def step(self) -> tf.Tensor:
        """This call's step number (same on every rank); the counter then advances."""
        if self._step is None:
            self._step = _state_variable(lambda: tf.constant(0, tf.int64),
                                         "matex_compression_step")
        return self._step.assign_add(1) - 1

    def reduce(self, items: Sequence[Item], op: str,
               threshold: int) -> tuple[list[tf.Tensor], list[int]]:
        """``(reduced gradients, bytes sent per item)`` for ``items`` (all selected)."""
        raise NotImplementedError

    def shared_variables(self) -> list[tf.Variable]:
        """State equal on every rank (the step counter; PowerSGD's Q): synced and digested."""
        return [] if self._step is None else [self._step]

    def rank_variables(self) -> list[tf.Variable]:
        """State of this rank alone (error-feedback residuals)."""
        memory = getattr(self, "memory", None)
        return memory.values() if memory is not None else []

    def recovery_state(self, optimizer: keras.optimizers.Optimizer,
                       variables: Callable[[], list[tf.Variable]]) -> CompressorState:
        """This compressor's step state for ``optimizer`` (``CompressorState``), which
        ``DistributedOptimizer`` joins to it: its step count moves when a step commits."""
        return CompressorState(self, lambda: int(optimizer.iterations))

    def __repr__(self):
        return "%s(min_size=%d)" % (type(self).__name__, self.min_size)


class CompressorState(_recovery.SnapshotState):
    """A compressor's per-step state under the recovery loop's commit rule.

    A step writes the residuals, PowerSGD's Q and the step counter while it
    runs, before the update is known to be committed on every rank: a rank
    loss in the middle leaves them as the failed attempt wrote them, and the
    redone step would add that attempt's residual a second time.
    ``begin_step`` snapshots them; ``restore`` puts them back when the step's
    update was not applied on this rank (``counter()`` did not move; state made
    during the failed step goes back to zero); ``sync`` takes rank 0's shared
    state (counter, Q), which ``arrays`` hands to the digest check; residuals
    are per rank and only restored.
    """

    def __init__(self, compressor, counter):
        self.compressor = compressor
        super().__init__(
            lambda: compressor.shared_variables() + compressor.rank_variables(), counter)

    def sync(self, root=0):
        from matex import _collectives

        _collectives.broadcast_variables(self.compressor.shared_variables(), root)

    def arrays(self):
        return [v.numpy() for v in self.compressor.shared_variables()]
