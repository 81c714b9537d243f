"""Keras 3, distributed: ``import matex.keras as keras`` in place of ``import keras``.

Every public Keras name is Keras's own; importing this module patches Keras
(see ``matex._keras``) so ``compile``/``fit``/``evaluate``/``predict``,
saving and loading behave as the single-process script meant, on all ranks.
On several ranks it also seeds Python's ``random``, NumPy and TensorFlow with
one seed from rank 0 (``matex._transparent``): import it before seeding.
"""

import sys
import types

import keras as _keras
from keras import *  # noqa: F401,F403 - the whole public Keras API

from matex._keras.install import install as _install

__version__ = _keras.__version__

_install()

# `from matex.keras import layers` works through the star import; make
# `import matex.keras.layers` work too.
for _name, _value in vars(_keras).items():
    if isinstance(_value, types.ModuleType) and not _name.startswith("_"):
        sys.modules.setdefault(__name__ + "." + _name, _value)


def __getattr__(name):
    return getattr(_keras, name)
