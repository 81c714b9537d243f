"""One wrapper around TF1's ``Session.run``, with named hooks.

TF1 graph code runs through ``tf.compat.v1.Session.run`` (directly, or under
``MonitoredTrainingSession`` and its wrapped sessions, which end in the same
method). Two parts of MaTEx need to act at that point:

- the graph-collective scheduler (every rank runs the MaTEx collectives that
  one ``run`` reaches in one agreed order), needed by any graph that holds a
  MaTEx collective;
- the unmodified-script path (``python -m matex`` / ``matexrun``), which
  gives each rank its rows of a fed batch and broadcasts rank 0's variables
  after the initialiser.

Each registers a hook under a name; the first ``add_run_hook`` installs the
wrapper once. A hook is called as ``hook(run, session, fetches, feed_dict,
options, run_metadata)`` and returns what ``run`` returns: it calls ``run``
(the next hook, or TensorFlow's method) with the same or changed arguments,
and may act before and after. Hooks run in the order they were added, except
those added with ``innermost=True`` (the scheduler), which run after all the
others, closest to TensorFlow: they see the fetches and feeds the other hooks
hand on.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from matex import _state

Hook = Callable[..., Any]

# name -> hook, in the order added
_hooks: dict[str, Hook] = _state.table("legacy.session.hooks", lifetime="process")
# the same, called after every hook of _hooks
_innermost: dict[str, Hook] = _state.table("legacy.session.innermost", lifetime="process")
_lock = threading.Lock()
# original: TensorFlow's BaseSession.run, once wrapped
_now = _state.namespace("legacy.session", original=None)


def _run_through_hooks(session, fetches, feed_dict=None, options=None, run_metadata=None):
    hooks = list(_hooks.values()) + list(_innermost.values())

    def call(index, fetches, feed_dict, options, run_metadata):
        if index == len(hooks):
            return _now.original(session, fetches, feed_dict, options, run_metadata)
        return hooks[index](functools.partial(call, index + 1), session, fetches, feed_dict,
                            options, run_metadata)

    return call(0, fetches, feed_dict, options, run_metadata)


def _install() -> None:
    if _now.original is not None:
        return
    from matex import _compat

    cls = _compat.tf1_base_session_class()
    original = _now.original = cls.run

    @functools.wraps(original)
    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        if not _hooks and not _innermost:
            return original(self, fetches, feed_dict, options, run_metadata)
        return _run_through_hooks(self, fetches, feed_dict, options, run_metadata)

    run._matex_wrapped = True   # type: ignore[attr-defined]
    cls.run = run


def add_run_hook(name: str, hook: Hook, innermost: bool = False) -> None:
    """Call ``hook`` around every TF1 ``Session.run`` from now on (replacing ``name``'s).

    ``innermost``: call it after every hook added without it, whenever added.
    """
    with _lock:
        _install()
        _hooks.pop(name, None)
        _innermost.pop(name, None)
        (_innermost if innermost else _hooks)[name] = hook


def remove_run_hook(name: str) -> None:
    """Stop calling the hook registered as ``name`` (no error if there is none)."""
    with _lock:
        _hooks.pop(name, None)
        _innermost.pop(name, None)


def run_hooks() -> list[str]:
    """The names of the hooks in force, in calling order."""
    return list(_hooks) + list(_innermost)
