"""The test suite's processes only: cheaper garbage collection around TensorFlow's import
and at exit.

``tests/conftest.py`` puts this folder first on ``PYTHONPATH`` for every process the
suite starts (``mpiexec`` passes it to a node's ranks). Measured on the 2-core machine,
``python -c "import keras"``:

* importing TensorFlow makes about half a million long-lived objects, and Python's
  collector scans them again and again while they are made: 0.5-0.8 s of the import.
  Here the youngest generation is collected only every million allocations until
  ``tensorflow`` or ``keras`` (whichever comes first) is imported; then the heap
  built so far is frozen (``gc.freeze``: never scanned again) and Python's thresholds
  are back;
* at exit the interpreter spends about one second collecting that module graph, which
  nothing needs: the heap is frozen by an exit handler registered first, so run last,
  after every other exit handler of the process (flushing, closing files, MaTEx's own).
  Python promises no finalizer of an object still alive at exit either way.

What the tests check is untouched: only when the collector runs changes.
"""

import atexit
import gc
import sys

atexit.register(gc.freeze)

_THRESHOLDS = gc.get_threshold()
_FRAMEWORKS = ("tensorflow", "keras")


class _CollectLessDuringImport:
    """A meta path finder that only watches: a framework's spec gets a loader that
    restores the collector once its import is done (a spec only looked up, as by
    ``importlib.util.find_spec``, changes nothing)."""

    def find_spec(self, name, path=None, target=None):
        if name not in _FRAMEWORKS:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        execute = getattr(spec.loader, "exec_module", None)
        if execute is None:
            _restore()
            return spec

        def exec_module(module):
            try:
                execute(module)
            finally:
                _restore()

        spec.loader.exec_module = exec_module
        return spec


def _restore():
    """The framework is imported: freeze what it built, Python's thresholds back."""
    if _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)
        gc.freeze()
        gc.set_threshold(*_THRESHOLDS)


_WATCHER = _CollectLessDuringImport()
gc.set_threshold(1_000_000, *_THRESHOLDS[1:])
sys.meta_path.insert(0, _WATCHER)
