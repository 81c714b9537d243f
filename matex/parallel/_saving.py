"""Every custom layer MaTEx offers loads with ``keras.saving.load_model`` after ``import matex``.

Keras finds a custom class in a saved file only through its registry
(``register_keras_serializable``), which is filled when the class's module is
imported; Keras itself imports no module outside its own packages. MaTEx's
layers (``StageBoundary``, ``ColumnParallelDense``, ``RowParallelDense``,
``ParallelConv2D``) live in modules that need Keras, and ``import matex`` must
stay cheap (no TensorFlow). So ``install()``, called by ``import matex``,
registers them at once if Keras is already loaded, and otherwise right after
Keras's own import finishes (a one-shot import hook for the ``keras``
package). Their modules import neither MPI nor MaTEx's collectives at import
time, so registering them is safe even while TensorFlow is still importing
(``import tensorflow`` loads Keras).
"""

import importlib
import importlib.abc
import importlib.util
import logging
import sys

from matex import _state

_log = logging.getLogger("matex")

# the modules whose import registers MaTEx's custom Keras layers
LAYER_MODULES = ("matex.parallel._stages", "matex.parallel._tensor")


def register() -> None:
    """Import the modules of MaTEx's custom layers (which registers them with Keras)."""
    for name in LAYER_MODULES:
        importlib.import_module(name)


def _register_after_keras() -> None:
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - must never break the user's `import keras`
        _log.warning("matex: could not register MaTEx's Keras layers (%s: %s); import "
                     "matex.parallel._stages / _tensor before keras.saving.load_model",
                     type(exc).__name__, exc)


class _AfterKeras(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``keras`` to register MaTEx's layers after it.

    It stays in place until Keras is actually executed: a bare
    ``importlib.util.find_spec("keras")`` (TensorFlow asks whether Keras is
    installed before importing it) loads nothing.
    """

    def __init__(self):
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "keras" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)   # the ordinary finders
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module):
            _uninstall()
            exec_module(module)
            _register_after_keras()

        loader.exec_module = exec_then_register
        return spec


_now = _state.namespace("parallel.saving", hook=None)   # the _AfterKeras finder in sys.meta_path


def _uninstall() -> None:
    if _now.hook is not None and _now.hook in sys.meta_path:
        sys.meta_path.remove(_now.hook)
    _now.hook = None


def install() -> None:
    """Register MaTEx's layers now if Keras is loaded, else once it is (idempotent)."""
    if "keras" in sys.modules:
        _register_after_keras()
        return
    if _now.hook is None:
        _now.hook = _AfterKeras()
        sys.meta_path.insert(0, _now.hook)
