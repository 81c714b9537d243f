"""What MaTEx raises, and how to tell a lost rank from a programming error.

Importing this module imports neither MPI nor TensorFlow, so classifying an
error is cheap. A failed collective reaches Python as a TensorFlow error
whose payload carries the MPI error class (the C++ side never aborts);
``mpi_error_class`` reads it back, and ``is_rank_failure`` says whether the
error means a peer died (``MPI_ERR_PROC_FAILED``) or the communicator was
revoked because one did (``MPI_ERR_REVOKED``). Ranks that disagree on the
collective to run get a payload too: ``is_mismatch``. Nothing here reads
message text.
"""

from typing import Iterable

__all__ = ["MatexError", "RankFailure", "MismatchError", "mpi_error_class", "is_rank_failure",
           "is_mismatch"]

_PAYLOAD_KEYS = (b"matex.mpi_error_class", "matex.mpi_error_class")
_MISMATCH_KEYS = (b"matex.mismatch", "matex.mismatch")


class MatexError(RuntimeError):
    """Base class of MaTEx's own errors."""


class RankFailure(MatexError):
    """A rank was lost and the job cannot (or may not) recover from it here."""

    def __init__(self, message: str, lost: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.lost = list(lost)


class MismatchError(MatexError):
    """Ranks disagree: replicas that must be identical differ, or ranks did different work."""


def _payload(error, keys):
    """The value of the first of ``keys`` among a TensorFlow error's payloads, or None."""
    payloads = getattr(error, "experimental_payloads", None) or {}
    return next((value for key, value in payloads.items() if key in keys), None)


def mpi_error_class(error: BaseException) -> int | None:
    """The MPI error class carried by ``error`` (a MaTEx op error or ``MPI.Exception``), or None."""
    value = _payload(error, _PAYLOAD_KEYS)
    if value is not None:
        return int(value)
    get_class = getattr(error, "Get_error_class", None)
    if callable(get_class):
        return get_class()
    return None


def is_mismatch(error: BaseException) -> bool:
    """Whether ``error`` says the ranks disagreed on the collective to run.

    The agreement check before every collective raises it on every rank (a
    ``MismatchError``, or a TensorFlow error carrying the check's payload).
    """
    return isinstance(error, MismatchError) or _payload(error, _MISMATCH_KEYS) is not None


def _failure_classes():
    from mpi4py import MPI

    return {c for c in (getattr(MPI, "ERR_PROC_FAILED", None),
                        getattr(MPI, "ERR_PROC_FAILED_PENDING", None),
                        getattr(MPI, "ERR_REVOKED", None)) if c is not None}


def is_rank_failure(error: BaseException) -> bool:
    """Whether ``error`` reports a failed peer or a revoked communicator."""
    if isinstance(error, RankFailure):
        return True
    error_class = mpi_error_class(error)
    return error_class is not None and error_class in _failure_classes()
