"""Per-rank random streams for the randomness layers draw inside a step.

A Keras layer's randomness (Dropout, GaussianNoise, GaussianDropout,
AlphaDropout, SpatialDropout, RNN and attention dropout, random augmentation
layers) comes from a ``keras.random.SeedGenerator`` whose state is a model
variable. ``fit`` starts every rank from rank 0's variables, so every rank
holds the same generator state, and ranks whose slices have the same shape
would draw the same masks: the noise would repeat across the global batch,
where one process draws it independently for every row.

``install()`` makes a seed drawn *inside a layer call* on world rank r > 0
``tf.random.experimental.stateless_fold_in(seed, r)``: an independent stream
per rank. Only the seed handed to the random op changes: the generator's
state variable advances exactly as in Keras, so it stays bitwise equal on
every rank (MaTEx compares replica digests after a recovery). World rank 0
keeps Keras's stream (a single process is unchanged), and world ranks are
stable when the job shrinks after a failure.

Randomness drawn outside a layer call is left shared: shuffles, data
generators and anything else the ranks must agree on (keras.random calls in a
data pipeline, a custom ``train_step`` drawing directly; to get per-rank noise
there, draw it inside a layer).
"""

import functools
import threading

import tensorflow as tf

from matex import _compat

_lock = threading.Lock()
_installed = False


# ---- the patch ---------------------------------------------------------------

def _world():
    """(rank, size) in MPI_COMM_WORLD: fixed for the life of the process."""
    from mpi4py import MPI

    from matex import _runtime

    _runtime.init()   # MPI started MaTEx's way (a no-op once the Keras patch ran)

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def rank_seed(seed, rank: int):
    """``seed`` (a [2] integer tensor) made specific to ``rank``; same dtype."""
    seed = tf.convert_to_tensor(seed)
    folded = tf.random.experimental.stateless_fold_in(seed, rank)
    return tf.cast(folded, seed.dtype)


def _next(original, rank):
    @functools.wraps(original)
    def next_seed(self, ordered=True):
        seed = original(self, ordered)
        if not _compat.in_layer_call() or not isinstance(seed, (tf.Tensor, tf.Variable)):
            return seed   # shared randomness, or another backend's generator
        return rank_seed(seed, rank)

    next_seed._matex_original = original
    return next_seed


def install() -> None:
    """Give layers' in-step randomness a stream per rank on ranks > 0 (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        import keras

        rank, size = _world()
        cls = keras.random.SeedGenerator
        if size > 1 and rank > 0 and getattr(cls.next, "_matex_original", None) is None:
            cls.next = _next(cls.next, rank)
        _installed = True
