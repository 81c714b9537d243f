"""mkdocs hook: ``<!-- error-index -->`` in a page becomes the index of every error message
MaTEx raises, read from the source at build time (so it cannot drift).

Each ``raise X("...")`` (and ``parser.error("...")`` of the launchers) under ``matex/`` and
``readers/`` whose message is a string literal, a ``"..." % args`` or an f-string gives one
row: the exception type, the message with its variable parts shown as ``…``, and where it is
raised (module and function).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_MARK = re.compile(r"^<!-- error-index -->$", re.M)
_FOLDERS = ("matex", "readers")


def _text(node: ast.AST) -> str | None:
    """The literal text of a message expression, variable parts as "…"; None if none."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = _text(node.left)
        return None if left is None else re.sub(r"%(\([^)]*\))?[-#0 +]*\d*(\.\d+)?[sdrfgxi%]",
                                                lambda m: "%" if m.group(0) == "%%" else "…",
                                                left)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else "…") + (right if right is not None else "…")
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "format" and isinstance(node.func.value, ast.Constant):
        return re.sub(r"\{[^}]*\}", "…", str(node.func.value.value))
    return None


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return "?"


def messages() -> list[tuple[str, str, str, str]]:
    """``(module, function, exception type, message)`` of every literal error message."""
    rows = []
    for folder in _FOLDERS:
        for path in sorted((ROOT / folder).glob("**/*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            parts = list(relative.parts)
            if parts[0] == "readers":
                parts = ["matex"] + parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            module = ".".join(parts)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for function, node in _walk(tree, "(module)"):
                call, kind = None, None
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    call, kind = node.exc, _name(node.exc.func)
                elif isinstance(node, ast.Call) and _name(node.func) == "error" and \
                        isinstance(node.func, ast.Attribute) and \
                        _name(node.func.value) == "parser":
                    call, kind = node, "matexrun: error" if "launcher" in module else \
                        "usage error"
                if call is None or not call.args:
                    continue
                text = _text(call.args[0])
                if text is None or not text.strip("… "):
                    continue
                rows.append((module, function, kind, " ".join(text.split())))
    return rows


def _walk(tree: ast.AST, function: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(node, node.name if function == "(module)" else function)
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node, node.name)
        else:
            yield function, node
            yield from _walk(node, function)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("`", "'")


def index_markdown() -> str:
    out = []
    by_module: dict[str, list] = {}
    for module, function, kind, text in messages():
        by_module.setdefault(module, []).append((function, kind, text))
    for module in sorted(by_module):
        out += ["### `%s`" % module, "", "| raised as | message | in |", "|---|---|---|"]
        out += ["| `%s` | %s | `%s` |" % (kind, _cell(text), function)
                for function, kind, text in by_module[module]]
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if not _MARK.search(markdown):
        return markdown
    return _MARK.sub(lambda m: index_markdown(), markdown)
