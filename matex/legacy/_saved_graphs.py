"""Graphs saved by an MPI job import in a later process: MaTEx's op types registered early.

A TF1 meta graph or a frozen ``GraphDef`` written by a MaTEx job names
``MatexAllreduce`` and the other MaTEx op types. ``import matex`` registers
them right after TensorFlow's own import, and installs the graph-collective
scheduler (``matex.legacy._schedule``) for such a graph's ``Session.run``.
This module imports neither TensorFlow nor MPI.
"""

import logging

from matex import _native, _transparent


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
    _transparent.after_import("tensorflow", _register_ops)


def _register_ops(tensorflow) -> None:
    if tensorflow is None:   # blocked (sys.modules["tensorflow"] = None): nothing to register
        return
    try:
        _native.tf_ops()
        # a graph imported here holds numbered collectives made by another process: its
        # Session.run is scheduled (and the kernels get the communicator) although this
        # process made no MaTEx op
        from matex.legacy import _schedule

        _schedule.install()
    except Exception as exc:  # noqa: BLE001 - must never break the user's `import tensorflow`
        logging.getLogger("matex").warning(
            "matex: could not load MaTEx's TensorFlow ops at import (%s: %s); graphs "
            "holding MaTEx ops will not import until they load", type(exc).__name__, exc)
