"""``matex.science`` needs the ``[science]`` extra: scipy (Lanczos) and matplotlib (plots).

Imported first by the package, so a missing one fails ``import matex.science``
with the ``pip install`` that adds it rather than a bare ModuleNotFoundError.
"""

from matex import _compat

_compat.require_extra(("scipy", "matplotlib"), "science", "matex.science")
