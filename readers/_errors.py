"""ReaderError, and the collective agreement that raises it on every rank alike."""

from matex import _runtime
from matex._everywhere import on_every_rank


class ReaderError(ValueError):
    """Bad reader input: missing file or field, corrupt data, inconsistent shapes, ...

    Raised on every rank with the same message, so no rank is left waiting in
    a collective that the others never reach.
    """


def agreed(fn, *args, discard=None, **kwargs):
    """``fn(*args, **kwargs)`` on every rank; if it failed on any rank, raise everywhere.

    All ranks raise a ReaderError naming the lowest failing rank and its error
    (the failing rank chains its own exception): ``matex._everywhere``'s rule,
    on MaTEx's control communicator, apart from data collectives.
    ``discard(result)`` is called on a rank whose own call succeeded when
    another rank failed.
    """
    return on_every_rank(_runtime.control(), fn, *args, error_type=ReaderError,
                         discard=discard, **kwargs)
