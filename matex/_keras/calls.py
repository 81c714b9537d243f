"""Calling and patching Keras methods: arguments by name, originals kept."""

import functools
import inspect


def bind(function, *args, **kwargs):
    """Arguments of a call, all named (edit ``.arguments``, call with ``call``)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def call(function, bound):
    return function(*bound.args, **bound.kwargs)


def patch(owner, name, wrapper, stands_down=False):
    """Replace ``owner.name`` by ``wrapper(original)``, once (the original stays reachable).

    ``stands_down`` (the transparent Keras patches): the patched method runs Keras's
    original once the script has imported an explicit layer
    (``matex._transparent.explicit_layer``: Horovod's): a patch for the
    unmodified-script path never meets a user's explicit calls.
    """
    original = getattr(owner, name)
    if getattr(original, "_matex_original", None) is not None:
        return
    patched = wrapper(original)
    if stands_down:
        from matex import _transparent

        active = patched

        @functools.wraps(original)
        def patched(*args, **kwargs):
            if _transparent.explicit_layer() is None:
                return active(*args, **kwargs)
            return original(*args, **kwargs)

    patched._matex_original = original
    setattr(owner, name, patched)
