"""One error on every rank: the rule that keeps a rank's exception from becoming a hang.

A rank that raises while its peers wait in a collective leaves them waiting
for ever. ``on_every_rank(comm, fn)`` runs ``fn`` on every rank of ``comm``
and then agrees, with one small allgather on ``comm``, whether it failed
anywhere; if it did, every rank raises the same error: ``error_type`` with the
message of the lowest failing rank (the failing rank chains its own
exception). Every MaTEx path that does rank-local work a peer waits for (a
save on one rank, a trial's body, a reader's open) goes through it, so the
catch rule is the same everywhere: any ``Exception``.

Lost ranks are not errors to agree on: under fault tolerance a lost rank
(``_resilience.is_failure``) propagates as it is, for the recovery loop, and
the agreeing allgather itself fails on every survivor when a peer is gone.
"""

from typing import Any, Callable, Optional, Type

from matex.errors import MatexError

__all__ = ["RemoteError", "on_every_rank", "on_root", "agree_error", "describe"]


class RemoteError(MatexError):
    """Raised on every rank when a rank-local step failed on some rank (the message says which)."""


def describe(exc: BaseException) -> str:
    """``"Type: message"``: how one rank's error is told to the others."""
    return "%s: %s" % (type(exc).__name__, exc)


def agree_error(comm, own: Optional[BaseException], error_type: Type[Exception] = RemoteError,
                what: str = "") -> None:
    """Raise ``error_type`` on every rank of ``comm`` if ``own`` is set on any rank.

    Collective. ``own`` is this rank's exception or None. The message names the
    lowest failing rank; ``what`` (e.g. ``"matex.hpo: trial 3"``) prefixes it.
    Returns normally only when no rank failed.
    """
    if own is not None and _is_lost_rank(own):
        raise own   # the recovery loop's business, not an error to agree on
    messages = comm.allgather(None if own is None else describe(own))
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    rank, message = failed[0]
    text = "rank %d: %s" % (rank, message)
    if len(failed) > 1:
        text += " (and %d more rank%s)" % (len(failed) - 1, "s" if len(failed) > 2 else "")
    if what:
        text = "%s: %s" % (what, text)
    raise error_type(text) from own


def on_every_rank(comm, fn: Callable[..., Any], *args, error_type: Type[Exception] = RemoteError,
                  what: str = "", discard: Optional[Callable[[Any], None]] = None,
                  **kwargs) -> Any:
    """``fn(*args, **kwargs)`` on every rank of ``comm``; if it raised anywhere, raise everywhere.

    Collective: every rank of ``comm`` must call it (``fn`` may do nothing on
    ranks with no part in the work). Returns ``fn``'s result when no rank
    failed; otherwise every rank raises ``error_type`` naming the lowest
    failing rank and its error. ``discard(result)`` is called on a rank whose
    own call succeeded when another's failed (to close what it opened).
    """
    result, own = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure must reach every rank
        own = exc
    try:
        agree_error(comm, own, error_type=error_type, what=what)
    except BaseException:
        if own is None and discard is not None and result is not None:
            discard(result)
        raise
    return result


def on_root(comm, fn: Callable[..., Any], *args, root: int = 0,
            error_type: Type[Exception] = RemoteError, what: str = "", **kwargs) -> Any:
    """``fn(*args, **kwargs)`` on rank ``root`` of ``comm`` alone; its result on every rank.

    Collective. If ``fn`` raised, every rank raises ``error_type`` (see
    ``on_every_rank``); otherwise ``root``'s result is broadcast to all.
    """
    mine = on_every_rank(comm, lambda: fn(*args, **kwargs) if comm.Get_rank() == root else None,
                         error_type=error_type, what=what)
    return comm.bcast(mine, root=root)


def _is_lost_rank(exc: BaseException) -> bool:
    from matex import _resilience

    return _resilience.is_failure(exc)
