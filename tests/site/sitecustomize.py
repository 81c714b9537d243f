"""The test suite's processes only: no final garbage collection of the whole heap at exit.

``tests/conftest.py`` puts this folder first on ``PYTHONPATH`` for every process the
suite starts (``mpiexec`` passes it to a node's ranks). A TensorFlow process's
interpreter spends about one second at exit collecting its module graph, which
nothing needs: freezing the heap (``gc.freeze``) skips it. This handler is
registered first, so it runs last: every exit handler of the process (flushing,
closing files, MaTEx's own) runs before it, as without it. Python promises no
finalizer of an object still alive at exit either way.
"""

import atexit
import gc

atexit.register(gc.freeze)
