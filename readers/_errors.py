"""ReaderError, and the collective agreement that raises it on every rank alike."""

from matex import _runtime


class ReaderError(ValueError):
    """Bad reader input: missing file or field, corrupt data, inconsistent shapes, ...

    Raised on every rank with the same message, so no rank is left waiting in
    a collective that the others never reach.
    """


def agreed(fn, *args, discard=None, **kwargs):
    """``fn(*args, **kwargs)`` on every rank; if it failed on any rank, raise everywhere.

    All ranks raise a ReaderError carrying the message of the lowest failing
    rank (the failing rank chains its own exception). ``discard(result)`` is
    called on a rank whose own call succeeded when another rank failed.
    """
    result, message, error = None, None, None
    try:
        result = fn(*args, **kwargs)
    except ReaderError as exc:
        message, error = str(exc), exc
    except Exception as exc:  # noqa: BLE001 - any failure must reach every rank
        message, error = "%s: %s" % (type(exc).__name__, exc), exc
    messages = _runtime.control().allgather(message)   # apart from data collectives
    first = next((m for m in messages if m is not None), None)
    if first is None:
        return result
    if error is None and discard is not None and result is not None:
        discard(result)
    raise ReaderError(first) from error
