"""Horovod's API on MaTEx: ``import horovod.tensorflow.keras as hvd`` scripts run unchanged.

``python -m matex --horovod script.py`` (or ``matexrun --horovod``) makes
``import horovod``, ``horovod.tensorflow``, ``horovod.tensorflow.keras`` and
``horovod.keras`` resolve to this package (``matex.horovod._alias``), so a
Horovod script needs no edit. Without the flag, import the modules directly:
``import matex.horovod.tensorflow.keras as hvd``.

The API is in ``matex.horovod.tensorflow`` (collectives, optimizer, tape),
``matex.horovod.tensorflow.keras`` and ``matex.horovod.keras`` (Keras 3
callbacks with Horovod's signatures). Horovod's conventions are kept where
they differ from MaTEx's: the gradients of ``broadcast`` and ``allgather``
are averaged over ranks (MaTEx sums them), and ranks that disagree on a
collective get ``tf.errors.FailedPreconditionError``. What differs from
Horovod is listed in docs/horovod.md.
"""

from matex import _version

matex_version = _version.__version__

# The Horovod release whose API this mirrors: scripts compare horovod.__version__ with
# Horovod's releases (e.g. to choose an API), not with MaTEx's. MaTEx's own version is
# matex_version.
__version__ = "0.28.1"

__all__: list[str] = []   # the API is in matex.horovod.tensorflow and .keras
