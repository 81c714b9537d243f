"""mkdocs hooks for the API reference (docs/api/).

* ``<!-- lazy-names: PACKAGE -->`` in a page becomes one ``::: module.Name`` block per name
  of PACKAGE's ``_LAZY`` table (``matex``, ``matex.hpo``, ``matex.parallel`` resolve their
  public names on first use, so mkdocstrings cannot find them in the package itself): a name
  added to the table is documented without editing the page.
* griffe's "Unsupported item in X.__all__" warning is dropped: an ``__all__`` built by
  concatenation (``[...] + OPTIONAL``) is valid Python that griffe cannot evaluate statically;
  every other warning still fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_MARK = re.compile(r"^<!-- lazy-names: (\S+) -->$", re.M)
_BLOCK = """::: {target}.{name}
    options:
      show_root_heading: true
      show_root_full_path: false
      heading_level: 2
"""


def lazy_names(package: str) -> dict[str, str]:
    """``{name: module}`` of ``package``'s ``_LAZY`` table, read from its source."""
    source = ROOT.joinpath(*package.split("."), "__init__.py").read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_LAZY":
            return ast.literal_eval(node.value)
    raise ValueError(f"{package} has no _LAZY table")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def expand(match: re.Match) -> str:
        return "\n".join(_BLOCK.format(target=target, name=name)
                         for name, target in lazy_names(match.group(1)).items())
    return _MARK.sub(expand, markdown)


class _DynamicAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unsupported item in" not in record.getMessage()


for _name in ("griffe", "mkdocs.plugins.griffe"):   # mkdocstrings routes griffe to the latter
    logging.getLogger(_name).addFilter(_DynamicAll())
