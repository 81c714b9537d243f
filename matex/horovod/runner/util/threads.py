"""``horovod.runner.util.threads.in_thread`` (imported by Horovod-style test helpers)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_thread(target: Callable[..., object], args: tuple = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Run ``target(*args)`` in a started background thread and return the thread.

    ``args`` must be a tuple (a ValueError otherwise, as in Horovod); with
    ``silent`` an exception of ``target`` is swallowed.
    """
    if not isinstance(args, tuple):
        raise ValueError("args must be a tuple, not %s, for a single argument use (arg,)"
                         % type(args))
    function = target
    if silent:
        def function(*call_args):
            try:
                target(*call_args)
            except Exception:  # noqa: BLE001 - silent asked for it
                pass
    thread = threading.Thread(target=function, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
