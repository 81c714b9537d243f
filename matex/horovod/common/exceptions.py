"""``horovod.common.exceptions``: the errors Horovod's elastic loop catches.

On MaTEx a lost rank reaches ``hvd.elastic.run`` as MPI's own failure (ULFM),
classified by ``matex._resilience.is_failure``, not as these classes; they
exist so that scripts which name them (``except HorovodInternalError``) import
and run.
"""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed because a rank was lost (Horovod's name for it)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed (never raised by MaTEx: a running job gains no host,
    and a lost one is a rank failure)."""

    def __init__(self, skip_sync: bool) -> None:
        super().__init__()
        self.skip_sync = skip_sync
