"""MaTEx's modules import one way, from low layers to high: no import circle.

Every ``import`` and ``from ... import`` in ``matex/`` counts, the lazy ones
inside functions included (a lazy import that leads back is a circle that only
shows later, at run time). A module importing a package that encloses it
(``import matex`` inside ``matex.horovod``) is not an edge: Python has begun
that package before any of its modules. Pure AST, no TensorFlow.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def modules(package_dir):
    """{dotted name: path} of every module under ``package_dir`` (a package's is its own)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def targets(name, path, node, known):
    """The known modules that one import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".")
            if path.name != "__init__.py":
                package = package[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        # `from a.b import c`: the module a.b.c if there is one, else a.b (c is a name in it)
        wanted = [base + "." + alias.name if base + "." + alias.name in known else base
                  for alias in node.names]
    out = set()
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            out.add(target)
    return out


def import_graph(package_dir):
    known = modules(package_dir)
    graph = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= targets(name, path, node, known)
    return graph


def circles(graph):
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_check_finds_a_circle(tmp_path):
    """The check itself: a lazy import inside a function that leads back is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg import low\n")
    (package / "low.py").write_text("def f():\n    from pkg.sub import high\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "high.py").write_text("from .. import low\nimport pkg\n")
    graph = import_graph(package)
    assert graph["pkg.sub.high"] == {"pkg.low"}       # `import pkg` encloses it: no edge
    assert circles(graph) == [["pkg.low", "pkg.sub.high"]]
    (package / "low.py").write_text("def f():\n    pass\n")
    assert circles(import_graph(package)) == []


def test_no_import_circle_in_matex():
    graph = import_graph(ROOT / "matex")
    assert len(graph) > 100, sorted(graph)
    found = circles(graph)
    if found:
        lines = []
        for group in found:
            lines.append("circle of %d: %s" % (len(group), ", ".join(group)))
            lines += ["  %s -> %s" % (a, b) for a in group for b in sorted(graph[a])
                      if b in group]
        pytest.fail("import circles among matex's modules:\n" + "\n".join(lines))
