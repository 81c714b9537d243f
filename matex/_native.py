"""Load MaTEx's compiled libraries (building them on first use).

``core()`` returns the pybind11 module over the C++ core (no TensorFlow
needed); ``tf_ops()`` returns the TensorFlow op library. Both share one
``libmatex_core.so``, hence one communicator state.
"""

import importlib.util
import logging
import sysconfig
import threading

_lock = threading.Lock()
_core = None
_ops = None


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
    global _core
    with _lock:
        if _core is None:
            from matex import _build

            directory = _build.core_dir()
            path = directory / ("_matex_core" + sysconfig.get_config_var("EXT_SUFFIX"))
            spec = importlib.util.spec_from_file_location("_matex_core", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _check_single_mpi()
            _core = module
    return _core


def tf_ops():
    """The TensorFlow op library (``tf.load_op_library`` result)."""
    global _ops
    if _ops is None:
        import tensorflow as tf

        from matex import _build

        directory = _build.tf_ops_dir()
        core()  # same libmatex_core.so: set the communicator before any op runs
        with _lock:
            if _ops is None:
                _ops = tf.load_op_library(str(directory / "matex_tf_ops.so"))
                _check_single_mpi()
    return _ops


def register_ops_when_tensorflow_loads() -> None:
    """Register every MaTEx op type as soon as TensorFlow is imported (now, if it is).

    A graph saved by an MPI job (a TF1 meta graph, a frozen ``GraphDef``)
    names ``MatexAllreduce`` and the other MaTEx op types; TensorFlow can
    import it only if they are registered. ``import matex`` therefore loads the
    op library right after TensorFlow's own import (``import matex`` stays
    cheap without TensorFlow). Loading needs no MaTEx communicator: it maps
    MPI's library, which mpi4py initialises (a singleton outside ``mpiexec``).
    A failure (no compiler for the first build) is a warning here; the first
    collective reports it again.
    """
    from matex import _transparent

    _transparent.after_import("tensorflow", _register_ops)


def _register_ops(tensorflow) -> None:
    if tensorflow is None:   # blocked (sys.modules["tensorflow"] = None): nothing to register
        return
    try:
        tf_ops()
        # a graph imported here holds numbered collectives made by another process: its
        # Session.run is scheduled (and the kernels get the communicator) although this
        # process made no MaTEx op
        from matex.legacy import _schedule

        _schedule.install()
    except Exception as exc:  # noqa: BLE001 - must never break the user's `import tensorflow`
        logging.getLogger("matex").warning(
            "matex: could not load MaTEx's TensorFlow ops at import (%s: %s); graphs "
            "holding MaTEx ops will not import until they load", type(exc).__name__, exc)
