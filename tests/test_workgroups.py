"""``matex._workgroups`` in one process: the layering its users rely on.

``matex.science`` shares the rank-group machinery with ``matex.hpo`` through
``matex._workgroups`` and imports nothing of ``matex.hpo`` (issue #24): a
loss surface must not depend on Keras Tuner glue, nor the search on science.
"""

import ast
import pathlib

import matex

PACKAGE = pathlib.Path(matex.__file__).parent


def _imported_modules(path):
    """Every module ``path`` imports, absolute (relative imports resolved), at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names |= {"%s.%s" % (base, alias.name) for alias in node.names}
    return names


def _offenders(folder, forbidden):
    return {str(path.relative_to(PACKAGE)): sorted(
        n for n in _imported_modules(path) if n == forbidden or n.startswith(forbidden + "."))
        for path in sorted((PACKAGE / folder).rglob("*.py"))}


def test_science_imports_nothing_from_hpo():
    found = {path: names for path, names in _offenders("science", "matex.hpo").items() if names}
    assert found == {}


def test_workgroups_import_neither_hpo_nor_science():
    for user in ("matex.hpo", "matex.science"):
        found = {p: n for p, n in _offenders("_workgroups", user).items() if n}
        assert found == {}, user


def test_the_import_check_sees_a_relative_and_a_nested_import(tmp_path, monkeypatch):
    """The check itself can fail: a function-level ``from ..hpo import x`` is found."""
    folder = PACKAGE / "science"
    probe = folder / "_probe_for_test_workgroups.py"
    monkeypatch.setattr(pathlib.Path, "rglob", lambda self, pattern: [probe])
    source = "def f():\n    from ..hpo._groups import Groups\n    import matex.hpo\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source)
    assert _offenders("science", "matex.hpo") == {
        "science/_probe_for_test_workgroups.py": ["matex.hpo", "matex.hpo._groups",
                                                  "matex.hpo._groups.Groups"]}

