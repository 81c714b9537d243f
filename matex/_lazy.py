"""Lazy package attributes: a public name imports its module on first use.

``import matex`` (and ``matex.hpo``, ``matex.parallel``) must stay cheap, so
names whose modules pull in TensorFlow, Keras Tuner or MPI are resolved when
first read (PEP 562), then cached in the package's namespace.
"""

import importlib
import sys
from typing import Any, Callable, Iterable


def attach(package: str, table: dict,
           names: Iterable[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a name to its module."""
    def __getattr__(name):
        module = table.get(name)
        if module is None:
            raise AttributeError("module %r has no attribute %r" % (package, name))
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
