"""``import horovod...`` resolves to ``matex.horovod...`` (``python -m matex --horovod``).

A ``sys.meta_path`` finder placed first: ``horovod.X`` is the module
``matex.horovod.X`` itself (one module object under both names), so
``hvd.callbacks`` and ``horovod.tensorflow.keras.callbacks`` are the same
thing whichever name imported it. A ``horovod.X`` that MaTEx does not provide
is a ``ModuleNotFoundError`` naming ``horovod.X``, as without Horovod.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

PREFIX = "horovod"
TARGET = "matex.horovod"


class _AliasLoader(importlib.abc.Loader):
    """Loads ``horovod.X`` as the already importable ``matex.horovod.X``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        pass   # executed under its own name by create_module


class HorovodFinder(importlib.abc.MetaPathFinder):
    """Finds ``horovod`` and ``horovod.*`` in ``matex.horovod``."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        real = TARGET + fullname[len(PREFIX):]
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            return None
        if found is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(real),
            is_package=found.submodule_search_locations is not None)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent).

    A ``horovod`` already imported (a real Horovod) is left in place, with a
    warning: the script would mix the two.
    """
    if any(isinstance(f, HorovodFinder) for f in sys.meta_path):
        return
    if PREFIX in sys.modules and not sys.modules[PREFIX].__name__.startswith(TARGET):
        import warnings

        warnings.warn("horovod is already imported; --horovod cannot replace it", stacklevel=2)
        return
    sys.meta_path.insert(0, HorovodFinder())
