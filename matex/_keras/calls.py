"""Calling and patching Keras methods: arguments by name, originals kept."""

import inspect


def bind(function, *args, **kwargs):
    """Arguments of a call, all named (edit ``.arguments``, call with ``call``)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def call(function, bound):
    return function(*bound.args, **bound.kwargs)


def patch(owner, name, wrapper):
    """Replace ``owner.name`` by ``wrapper(original)``, once (the original stays reachable)."""
    original = getattr(owner, name)
    if getattr(original, "_matex_original", None) is not None:
        return
    patched = wrapper(original)
    patched._matex_original = original
    setattr(owner, name, patched)
