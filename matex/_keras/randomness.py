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

TensorFlow's own stateful random ops created inside a layer call
(``tf.random.normal``/``uniform``, ``tf.nn.dropout``, as keras-io's VAE
``Sampling`` layer uses) take their seeds from TensorFlow's global seed,
which MaTEx (or the script) sets alike on every rank: on world rank r > 0
their op seed is shifted by r (``_get_seed``), so each rank draws its own
values, as rows of one process would. Without a global or op seed TensorFlow
draws from the OS's entropy, already different per rank; stateless ops
(``tf.random.stateless_*``) take the seed the script gives them, unchanged.

Randomness drawn outside a layer call is left shared: shuffles, data
generators and anything else the ranks must agree on (keras.random calls in a
data pipeline, a custom ``train_step`` drawing directly; to get per-rank noise
there, draw it inside a layer).
"""

import functools
import threading

import tensorflow as tf

from matex import _compat, _state

_lock = threading.Lock()
_now = _state.namespace("keras.randomness", "process", installed=False)


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


_MAXINT32 = 2 ** 31 - 1
_RANK_STRIDE = 0x9E3779B1   # spreads ranks far from the small op seeds TensorFlow counts


def _get_seed(original, rank):
    @functools.wraps(original)
    def get_seed(op_seed):
        seeds = original(op_seed)
        if seeds[0] is None or not _compat.in_layer_call():
            return seeds   # OS entropy (already per rank), or shared randomness
        shifted = (seeds[0], (int(seeds[1]) + rank * _RANK_STRIDE) % _MAXINT32)
        return (0, _MAXINT32) if shifted == (0, 0) else shifted   # (0, 0) means "unseeded"

    get_seed._matex_original = original
    return get_seed


def install() -> None:
    """Give layers' in-step randomness (Keras generators, TensorFlow's stateful random ops)
    a stream per rank on ranks > 0 (idempotent)."""
    with _lock:
        if _now.installed:
            return
        import keras

        rank, size = _world()
        cls = keras.random.SeedGenerator
        if size > 1 and rank > 0 and getattr(cls.next, "_matex_original", None) is None:
            cls.next = _next(cls.next, rank)
        seeds = _compat.tf_random_seed_module()
        if size > 1 and rank > 0 and getattr(seeds.get_seed, "_matex_original", None) is None:
            seeds.get_seed = _get_seed(seeds.get_seed, rank)
        _now.installed = True
