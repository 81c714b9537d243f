"""Work served over MPI: one rank owns it, every group leader asks it.

The owner (service rank ``owner_rank``, 0 at first) answers requests from a
background thread (``Server``): a request is ``(op, args)`` sent with tag
``REQUEST``, the answer ``(ok, value)`` comes back with tag ``REPLY``. The
handler is any callable ``handler(op, args)``; the owner's own calls go to it
directly (``Client``), so a handler used from two threads keeps its own lock.

The thread polls (``Iprobe`` and a short sleep): a blocking receive from any
source could not be stopped at the end of the run, and under ULFM a failed
peer must not end the service (its error is acknowledged, ``on_failure`` is
told the failed ranks, and the service goes on).

Under ULFM the owner itself may die. A rank whose request to the owner fails
with a rank-failure error acknowledges the failures it knows of and sends to
the lowest service rank still alive; that rank, when its own request fails
the same way, takes over (``Client``'s ``take_over`` builds its handler, e.g.
from what the old owner wrote to disk). No collective is needed, so ranks busy
working are not disturbed. Whether a rank owns the work is an explicit state
machine (``matex._workgroups.machine.Ownership``: following, then owning after
a takeover).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any, Callable, Optional

from matex._workgroups.machine import FOLLOWING, OWNING, Ownership

REQUEST, REPLY = 7101, 7102
POLL_SECONDS = 0.002

log = logging.getLogger("matex.workgroups")


class Server:
    """The owner's thread answering the other ranks over ``comm``.

    ``what`` names the service in its messages (e.g. "the oracle": "the
    oracle's service failed on this request: ...").
    """

    def __init__(self, comm, handler: Callable[[str, tuple], Any],
                 on_failure: Optional[Callable[[set], None]] = None,
                 what: str = "the work queue"):
        self.comm, self.handler, self.on_failure = comm, handler, on_failure
        self.what = what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="matex-workgroups",
                                        daemon=True)
        self.failed = set()   # service ranks known dead (ULFM)
        self.error = None

    def start(self) -> "Server":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self):
        """Answer requests until stopped; no error of one request ends the service.

        A request that cannot be read or answered (e.g. a reply that cannot be
        pickled) gets an error reply; any other error is kept in ``error`` (and
        in the handler's ``fatal`` when it has one: the run ends with it on
        every rank) while the thread goes on answering, so no rank waits for
        an answer that never comes. Lost peers (ULFM) are acknowledged.
        """
        from mpi4py import MPI

        status = MPI.Status()
        errors_in_a_row = 0
        while not self._stop.is_set():
            source = None
            try:
                if not self.comm.Iprobe(MPI.ANY_SOURCE, REQUEST, status):
                    time.sleep(POLL_SECONDS)
                    continue
                source = status.Get_source()
                op, args = self.comm.recv(source=source, tag=REQUEST)
                try:
                    reply = (True, self.handler(op, args))
                except Exception as exc:  # noqa: BLE001 - sent back, raised on the asking rank
                    reply = (False, "%s: %s\n%s" % (type(exc).__name__, exc,
                                                     traceback.format_exc()))
                self._send(reply, source)
                errors_in_a_row = 0
            except Exception as exc:  # noqa: BLE001 - never a silent end of the service
                if self._lost_peer(exc):
                    continue
                errors_in_a_row += 1
                self._failed(exc, source)
                if errors_in_a_row >= 100:   # the communicator itself is unusable
                    log.error("matex: %s's service stops after 100 errors in a row", self.what)
                    return
                time.sleep(POLL_SECONDS)

    def _send(self, reply, dest):
        """Send ``reply``; one that cannot be pickled becomes an error reply.

        mpi4py pickles before it sends anything, so nothing of it has gone.
        """
        from mpi4py import MPI

        try:
            self.comm.send(reply, dest=dest, tag=REPLY)
        except MPI.Exception:
            raise
        except Exception as exc:  # noqa: BLE001 - the asking rank raises it
            self.comm.send((False, "the answer cannot be sent: %s: %s" % (type(exc).__name__,
                                                                         exc)),
                           dest=dest, tag=REPLY)

    def _lost_peer(self, exc) -> bool:
        """Under ULFM a lost peer is acknowledged and the service goes on."""
        from matex import _resilience

        if not _resilience.is_failure(exc):
            return False
        self._acknowledge()
        return True

    def _failed(self, exc, source):
        """An error of the service itself: kept, and the run ends with it everywhere."""
        if self.error is None:
            self.error = exc
            log.error("matex: %s's service failed: %s: %s\n%s", self.what, type(exc).__name__,
                      exc, traceback.format_exc())
        if self.handler is not None and getattr(self.handler, "fatal", "") is None:
            self.handler.fatal = "%s's service failed: %s: %s" % (self.what, type(exc).__name__,
                                                                  exc)
        if source is not None:   # the asking rank must not wait for ever
            try:
                self.comm.send((False, "%s's service failed on this request: %s: %s"
                                % (self.what, type(exc).__name__, exc)), dest=source, tag=REPLY)
            except Exception:  # noqa: BLE001 - nothing more can be done for it
                pass

    def _acknowledge(self):
        """Acknowledge failed peers so receives from any source work again (ULFM)."""
        self.comm.Ack_failed()
        self.failed |= set(failed_ranks(self.comm))
        if self.on_failure is not None:
            self.on_failure(self.failed)


def failed_ranks(comm) -> list:
    """Ranks of ``comm`` whose failure this rank has acknowledged (ULFM)."""
    from mpi4py import MPI

    failed, whole = comm.Get_failed(), comm.Get_group()
    try:
        return [r for r in MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), whole)
                if r != MPI.UNDEFINED]
    finally:
        failed.Free()
        whole.Free()


class RemoteError(RuntimeError):
    """The owner raised while answering this rank's request."""


class Client:
    """A rank's way to the work: local calls on the owner, MPI requests elsewhere.

    ``groups`` (a ``matex._workgroups.groups.Groups``) holds the service
    communicator and the owner's rank there; ``handler`` is the owner's
    handler (None on other ranks); ``take_over(dead)`` makes this rank the
    owner and returns its handler (None: the owner's loss is an error here).
    ``what`` names the work in messages ("the oracle").
    """

    def __init__(self, groups, handler: Optional[Callable[[str, tuple], Any]],
                 take_over: Optional[Callable[[set], Callable]] = None,
                 what: str = "the work queue", source: str = "what it wrote"):
        self.groups, self.handler, self.take_over = groups, handler, take_over
        self.what, self.source = what, source
        self.ownership = Ownership(OWNING if handler is not None else FOLLOWING)

    def __call__(self, op: str, *args) -> Any:
        from mpi4py import MPI

        from matex import _resilience, _runtime

        while not self.ownership.owning:
            comm, owner = self.groups.service, self.groups.owner_rank
            try:
                comm.send((op, args), dest=owner, tag=REQUEST)
                ok, value = comm.recv(source=owner, tag=REPLY)
            except MPI.Exception as exc:
                if not _resilience.is_failure(exc) or _runtime.ft_mode() != "ulfm" \
                        or self.take_over is None:
                    raise
                self._fail_over(owner)
                continue   # resend: to the next owner, or to this rank's own handler
            if not ok:
                raise RemoteError("%s's owner (rank %d) failed on %s: %s"
                                  % (self.what, owner, op, value))
            return value
        return self.handler(op, args)

    def _fail_over(self, owner):
        """The owner is lost: the lowest rank alive owns the work now (maybe this one)."""
        comm = self.groups.service
        comm.Ack_failed()
        dead = set(failed_ranks(comm)) | {owner}
        new = min(r for r in range(comm.Get_size()) if r not in dead)
        log.warning("matex: %s's owner (rank %d) is lost; rank %d takes over from %s",
                    self.what, owner, new, self.source)
        self.groups.owner_rank = new
        if new == comm.Get_rank():
            self.handler = self.take_over(dead)
            self.ownership.fire("take_over")   # from now on this rank's requests stay here
        else:
            self.ownership.fire("owner_lost")
