"""MaTEx's modules import one way, from low layers to high: no import circle.

Every ``import`` and ``from ... import`` in ``matex/`` counts, the lazy ones
inside functions included (a lazy import that leads back is a circle that only
shows later, at run time). A module importing a package that encloses it
(``import matex`` inside ``matex.horovod``) is not an edge: Python has begun
that package before any of its modules. And MaTEx's modules import their own
functions from where they are defined: none reads a name through the ``matex``
package (``matex.allreduce(...)``, ``getattr(matex, ...)``), which hides the edge
from this check and probes the package at run time. Pure AST, no TensorFlow.
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


def package_reads(package_dir, package):
    """``(path, line, text)`` of each ``package.name`` read and ``getattr(package, ...)``."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        if path == package_dir / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == package):
                found.append((path.relative_to(package_dir.parent), node.lineno,
                              "%s.%s" % (package, node.attr)))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and node.args
                  and isinstance(node.args[0], ast.Name) and node.args[0].id == package):
                found.append((path.relative_to(package_dir.parent), node.lineno,
                              "%s(%s, ...)" % (node.func.id, package)))
    return found


def test_the_package_read_check_finds_one(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg._low import f\n")
    (package / "_low.py").write_text("def f():\n    return 1\n")
    (package / "_high.py").write_text(
        "import pkg\n\n\ndef g():\n    return pkg.f() if hasattr(pkg, 'f') else 0\n")
    assert sorted(text for _, _, text in package_reads(package, "pkg")) == [
        "hasattr(pkg, ...)", "pkg.f"]


def test_matex_modules_import_their_functions():
    reads = package_reads(ROOT / "matex", "matex")
    assert not reads, "read through the matex package, not imported from their modules:\n" + \
        "\n".join("  %s:%d %s" % read for read in reads)
