"""The flight recorder: each rank's last collectives, dumped when something goes wrong.

The C++ core keeps the last ``MATEX_FLIGHT_ENTRIES`` (default 1024)
collectives of each rank in a ring buffer: communicator and number on it, op, dtype, shape,
communicator size, start, agreement and end times, outcome, call site (the
TensorFlow node name, or the Python ``file:line`` for the NumPy core API).
Each rank writes ``MATEX_FLIGHT_DIR/rank<N>.json`` (default ``./matex-flight``):

* on ``SIGUSR1`` (``kill -USR1 <pid>``; no MPI involved, so it works while
  the rank is blocked);
* on a rank failure under ``--ft`` (the survivors, before recovering);
* on a stall report or stall abort (``MATEX_STALL_WARNING_S``,
  ``MATEX_STALL_ABORT_S``);
* at exit, when a collective failed since the last dump (e.g. a mismatch);
* when ``matex.flight.dump()`` is called.

``python -m matex.flight DIR`` reads the dumps of all ranks and says where
they first diverge, or which rank stopped first.
"""

from matex.flight._analysis import FlightError, Finding, analyse, load
from matex.flight._recorder import describe, dump

__all__ = ["dump", "load", "analyse", "describe", "Finding", "FlightError"]
