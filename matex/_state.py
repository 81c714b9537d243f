"""One home for MaTEx's process state, with one reset.

Every piece of state a MaTEx module keeps between calls lives here under a
name (``"runtime"``, ``"parallel.schedule.plans"``, ...), registered by the
module that owns it when that module is imported: the communicators, caches of
models, graphs and plans, installed patches, settings decided once. No module
keeps a ``global`` of its own (``tests/test_state.py`` checks it), so
``registered()`` is the whole list, and one call resets it.

Each entry has a lifetime:

* ``"process"``: held for the process's whole run: the communicators (which
  the resilience layer replaces through their owner, never clears), the
  loaded native library, installed patches, classes made once per base class,
  the process sets every rank registered alike. ``clear_session`` keeps them:
  dropping one on one rank would part it from its peers.
* ``"session"``: caches of models, graphs, variables and plans, rebuilt on
  demand. ``clear_session`` empties them.
* ``"thread"``: per-thread markers (``threading.local``: "inside this call").

A module keeps a reference to its entry (``_plans = _state.table(...)``), so a
read costs what a module global costs. A reset changes an entry in place (a
table is emptied, a namespace's attributes go back to their defaults) and
never replaces it, so no module is left holding a stale one.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable

LIFETIMES = ("process", "session", "thread")

_lock = threading.Lock()
_entries: dict[str, tuple[str, Any]] = {}   # name -> (lifetime, the entry)


class Namespace:
    """One module's scalar state: attributes declared with their defaults.

    Setting an undeclared attribute is an AttributeError, so a misspelt name
    fails where it is written instead of becoming new, unreset state.
    """

    def __init__(self, name: str, defaults: dict[str, Any]):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_defaults", dict(defaults))
        self.__dict__.update(defaults)

    def __getattr__(self, key: str) -> Any:   # reached only for an undeclared name
        name = self.__dict__.get("_name", "?")
        raise AttributeError("MaTEx state %r has no attribute %r" % (name, key))

    def __setattr__(self, key: str, value: Any) -> None:
        if key not in self._defaults:
            raise AttributeError("MaTEx state %r has no attribute %r (declare it, with its "
                                 "default, where the namespace is made)" % (self._name, key))
        object.__setattr__(self, key, value)

    def _reset(self) -> None:
        self.__dict__.update(self._defaults)

    def __repr__(self) -> str:
        values = ", ".join("%s=%r" % (k, self.__dict__[k]) for k in self._defaults)
        return "<matex state %s: %s>" % (self._name, values)


def _register(name: str, lifetime: str, make: Callable[[], Any]) -> Any:
    if lifetime not in LIFETIMES:
        raise ValueError("lifetime %r is not one of %s" % (lifetime, LIFETIMES))
    with _lock:
        if name in _entries:
            held_lifetime, entry = _entries[name]
            if held_lifetime != lifetime:
                raise ValueError("MaTEx state %r is already registered as %s state"
                                 % (name, held_lifetime))
            return entry   # the same module imported again (under a second name): one state
        entry = make()
        _entries[name] = (lifetime, entry)
        return entry


def namespace(name: str, lifetime: str = "process", **defaults: Any) -> Namespace:
    """The namespace ``name``, made with ``defaults`` at its first registration."""
    return _register(name, lifetime, lambda: Namespace(name, defaults))


def table(name: str, lifetime: str = "session", factory: Callable[[], Any] = dict) -> Any:
    """The container ``name`` (``factory()``: a dict, list, set or weak dictionary)."""
    made = _register(name, lifetime, factory)
    if not hasattr(made, "clear"):
        raise TypeError("MaTEx state %r: a table needs a clear() method, %s has none"
                        % (name, type(made).__name__))
    return made


def weak_table(name: str, lifetime: str = "session") -> weakref.WeakKeyDictionary:
    """A table whose keys (graphs, models) it does not keep alive."""
    return table(name, lifetime, weakref.WeakKeyDictionary)


def local(name: str) -> threading.local:
    """Per-thread markers under ``name``."""
    return _register(name, "thread", threading.local)


def registered() -> dict[str, str]:
    """``{name: lifetime}`` of every entry, in the order registered."""
    with _lock:
        return {name: lifetime for name, (lifetime, _) in _entries.items()}


def entry(name: str) -> Any:
    """The entry registered as ``name`` (a KeyError if none is)."""
    with _lock:
        return _entries[name][1]


def clear_session() -> None:
    """Empty every ``"session"`` entry of MaTEx, and Keras's own state when Keras is loaded.

    Local, not collective. For scripts that build model after model in one
    process (a search, a loop over configurations): the caches MaTEx made for
    earlier models, graphs and plans go (byte ledgers, so ``matex.stats()``
    counts anew; compressors; pipeline and TF1 graph plans), and are rebuilt
    for the next model on demand. The communicators, process sets and installed patches stay.
    One call resets both libraries: it ends with ``keras.backend.clear_session()``
    when Keras has been imported (and tf-keras's, for Keras 2 scripts).
    """
    with _lock:
        held = [entry for lifetime, entry in _entries.values() if lifetime == "session"]
    for entry in held:
        if isinstance(entry, Namespace):
            entry._reset()
        else:
            entry.clear()
    for name in ("keras", "tf_keras"):
        keras = sys.modules.get(name)
        if keras is not None and hasattr(keras, "backend"):
            keras.backend.clear_session()
