"""Load MaTEx's compiled libraries (building them on first use).

``core()`` returns the pybind11 module over the C++ core (no TensorFlow
needed); ``tf_ops()`` returns the TensorFlow op library. Both share one
``libmatex_core.so``, hence one communicator state.
"""

import importlib.util
import sysconfig
import threading

from matex import _state

_lock = threading.Lock()
_held = _state.namespace("native", core=None,   # the _matex_core pybind11 module, once loaded
                         ops=None)              # the TensorFlow op library, once loaded


def _check_single_mpi():
    """Fail loudly when two different MPI libraries are mapped in this process."""
    from matex import _build

    libs = _build.mapped_libmpis()
    if len(libs) > 1:
        raise ImportError(
            "MaTEx and mpi4py use different MPI libraries (%s). Rebuild mpi4py "
            "against the MPI you launch with (pip install --no-binary mpi4py "
            "--force-reinstall mpi4py), or remove the stale build in %s."
            % (", ".join(libs), _build.build_root())
        )


def core():
    """The ``_matex_core`` pybind11 module."""
    with _lock:
        if _held.core is None:
            from matex import _build

            directory = _build.core_dir()
            path = directory / ("_matex_core" + sysconfig.get_config_var("EXT_SUFFIX"))
            spec = importlib.util.spec_from_file_location("_matex_core", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _check_single_mpi()
            _held.core = module
    return _held.core


def loaded():
    """The core if some caller has loaded it, else None (loads nothing)."""
    return _held.core


def tf_ops():
    """The TensorFlow op library (``tf.load_op_library`` result)."""
    if _held.ops is None:
        import tensorflow as tf

        from matex import _build

        directory = _build.tf_ops_dir()
        core()  # same libmatex_core.so: set the communicator before any op runs
        with _lock:
            if _held.ops is None:
                _held.ops = tf.load_op_library(str(directory / "matex_tf_ops.so"))
                _check_single_mpi()
    return _held.ops
