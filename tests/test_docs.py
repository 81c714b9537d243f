"""The documentation site builds with warnings as errors, its API reference comes from
the docstrings, and the README stays a front page (issue #26, part 3)."""

import ast
import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _text(page: Path) -> str:
    """The visible text of a built HTML page, whitespace collapsed."""
    raw = re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))
    return " ".join(html.unescape(raw).split())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.fail(f"{module} is missing: pip install -e '.[docs]' (make test installs it)")
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + proc.stdout + proc.stderr
    return out


def _module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` (``matex.readers`` lives in ``readers/``)."""
    parts = dotted.split(".")
    if parts[:2] == ["matex", "readers"]:
        parts = parts[1:]
    base = ROOT.joinpath(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _definition(module: str, name: str, depth: int = 0):
    """(docstring, module) of ``name`` defined in or re-exported by ``module``, following
    ``from x import name``; None for a constant."""
    path = _module_file(module)
    if path is None:        # outside MaTEx (Keras, TensorFlow)
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return ast.get_docstring(node)
        if isinstance(node, ast.ImportFrom) and depth < 4:
            if any(alias.name == name and alias.asname in (None, name) for alias in node.names):
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                source = (package + "." + (node.module or "")).strip(".") if node.level \
                    else node.module
                return _definition(source, name, depth + 1)
    return None


def _first_line(doc: str) -> str:
    return "".join(doc.strip().splitlines()[0].replace("``", "").split())


def test_api_reference_is_generated_from_the_docstrings(site):
    # every `::: target` of docs/api/*.md: on its built page, the target's docstring's first
    # line; for a module, every name of its __all__ and each one's docstring's first line
    checked = 0
    for source in sorted((ROOT / "docs" / "api").glob("*.md")):
        page = _text(site / "api" / source.stem / "index.html")
        flat = "".join(page.split())    # tags around ``code`` split words differently
        for target in re.findall(r"^::: (\S+)", source.read_text(encoding="utf-8"), re.M):
            module = "matex.readers" if target == "readers" else target
            if _module_file(module) is not None:
                tree = ast.parse(_module_file(module).read_text(encoding="utf-8"))
                assert _first_line(ast.get_docstring(tree)) in flat, (source.name, target)
                names = next((ast.literal_eval(n.value) for n in tree.body
                              if isinstance(n, ast.Assign)
                              and getattr(n.targets[0], "id", "") == "__all__"), [])
                lazy = next((ast.literal_eval(n.value) for n in tree.body
                             if isinstance(n, ast.Assign)
                             and getattr(n.targets[0], "id", "") == "_LAZY"), {})
                for name in names:
                    if name in lazy:        # resolved on first use: document its definition
                        doc = _definition(lazy[name], name)
                        assert doc, f"{module}.{name} has no docstring"
                        assert name in page and _first_line(doc) in flat, (source.name, name)
                        checked += 1
                # the rest is documented by `::: module` itself; a submodule in __all__ has its
                # own page
                names = [n for n in names
                         if n not in lazy and not (source.parent / f"{n}.md").is_file()]
                for name in names:
                    assert name in page, (source.name, name)
                    doc = _definition(module, name)
                    if doc:
                        assert _first_line(doc) in flat, (source.name, name)
                        checked += 1
            else:
                module, name = target.rsplit(".", 1)
                assert name in page, (source.name, target)
                doc = _definition(module, name)
                assert doc, f"{target} has no docstring"
                assert _first_line(doc) in flat, (source.name, target)
                checked += 1
    assert checked > 100, checked   # the public API, not a handful
    print(checked, "docstrings checked")


def test_every_public_module_has_an_api_page(site):
    pages = {p.parent.name for p in (site / "api").glob("*/index.html")}
    assert {"matex", "keras", "readers", "hpo", "parallel", "science", "callbacks", "compression",
            "localsgd", "timeline", "flight", "errors", "launcher"} <= pages
    # the readers page is rendered from readers/__init__.py (installed as matex.readers)
    assert "DataSet" in _text(site / "api" / "readers" / "index.html")


def test_manual_pages_and_images_are_in_the_site(site):
    for page in ("getting-started", "data-parallel", "readers", "fault-tolerance", "search",
                 "model-parallel", "communicating-less", "observability", "science", "hpc",
                 "troubleshooting", "performance", "limitations", "development"):
        assert (site / page / "index.html").is_file(), page
    built = " ".join(p.read_text(encoding="utf-8") for p in site.glob("**/index.html"))
    for image in ROOT.glob("docs/*.png"):
        assert (site / image.name).is_file(), image.name
        assert image.name in built, f"no page shows {image.name}"



def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move text to docs/"
    # its links to the manual resolve (relative, so they work on GitHub too)
    for target in re.findall(r"\]\((docs/[^)#\s]+)", "\n".join(lines)):
        assert (ROOT / target).exists(), target
