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
    body = [inner for node in tree.body        # `if _has(name): def name(...)` counts too
            for inner in (node.body if isinstance(node, ast.If) else [node])]
    for node in body:
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
                 "troubleshooting", "performance", "limitations", "development", "errors",
                 "reference/cli", "reference/environment"):
        assert (site / page / "index.html").is_file(), page
    built = " ".join(p.read_text(encoding="utf-8") for p in site.glob("**/index.html"))
    for image in ROOT.glob("docs/*.png"):
        assert (site / image.name).is_file(), image.name
        assert image.name in built, f"no page shows {image.name}"



def test_error_index_lists_the_messages_the_code_raises(site):
    # docs/errors.md's index is read from the source at build time (docs/hooks/errors_index.py)
    spec = importlib.util.spec_from_file_location("matex_docs_errors",
                                                  ROOT / "docs" / "hooks" / "errors_index.py")
    index = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(index)
    rows = index.messages()
    assert len(rows) > 300, len(rows)
    page = _text(site / "errors" / "index.html")
    assert "The matex logger" in page or "the matex logger" in page.lower()
    for module, _, kind, text in rows[::25]:
        assert module in page and kind in page, (module, kind)
        assert " ".join(text.split()[:4]) in page, text


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move text to docs/"
    # its links to the manual resolve (relative, so they work on GitHub too)
    for target in re.findall(r"\]\((docs/[^)#\s]+)", "\n".join(lines)):
        assert (ROOT / target).exists(), target


# --- every name a page gives exists in the code (import-free: argparse, the registry, AST) ---

def _load_generator():
    spec = importlib.util.spec_from_file_location("matex_docs_reference",
                                                  ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    """The manual's pages and the README (the changelog is history: it names what was)."""
    pages = [p for p in sorted((ROOT / "docs").glob("**/*.md")) if p.name != "changelog.md"]
    return pages + [ROOT / "README.md"]


_FENCE = re.compile(r"^ *```[^\n]*\n(.*?)^ *```", re.M | re.S)


def _code(text: str) -> list[str]:
    """The code of ``text``: its fenced blocks' lines (continuations joined) and its inline
    code spans."""
    lines = []
    for block in _FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    outside = _FENCE.sub("", text)
    lines += [" ".join(span.split())           # a span may wrap onto the next line
              for span in re.findall(r"``?([^`\n]+(?:\n[^`\n]+){0,3})``?", outside)]
    return lines


def _command_flags(line: str, command: str, takes_value) -> list[str]:
    """The flags given to ``command`` on ``line`` (up to its script or module)."""
    found = []
    for match in re.finditer(r"(?:^|[\s;&|(`$])" + re.escape(command) + r"(?=\s)", line):
        tokens = line[match.end():].split()
        skip = False
        for token in tokens:
            if skip:
                skip = False
                continue
            if not token.startswith("-") or token in ("-", "--") or token.startswith("-m"):
                break               # the script (or -m MODULE): the rest is its own
            flag = token.split("=", 1)[0]
            found.append(flag)
            skip = "=" not in token and takes_value(flag)
    return found


def _matexrun_options():
    sys.path.insert(0, str(ROOT))
    from matex.launcher.cli import build_parser

    actions = {}
    for action in build_parser()._actions:
        for flag in action.option_strings:
            actions[flag] = action
    return actions


def test_reference_pages_match_the_code():
    # docs/reference/*.md are generated (make docs): the committed pages are what the
    # generator writes from the argparse and the registry now
    generated = _load_generator().generate()
    for name, text in generated.items():
        page = ROOT / "docs" / "reference" / name
        assert page.is_file() and page.read_text(encoding="utf-8") == text, (
            f"docs/reference/{name} is stale: run python docs/hooks/reference.py")


def test_every_documented_flag_exists():
    actions = _matexrun_options()
    python_m_matex = _load_generator().python_m_matex_flags()
    assert {"--ft", "--elastic", "-H", "--horovod"} <= set(actions), sorted(actions)
    assert {"--all-ranks", "--horovod", "-m", "--check", "--build"} <= python_m_matex

    def takes_value(flag):
        return flag in actions and actions[flag].nargs != 0

    wrong, checked = [], 0
    for page in _pages():
        for line in _code(page.read_text(encoding="utf-8")):
            for flag in _command_flags(line, "matexrun", takes_value):
                checked += 1
                if flag not in actions:
                    wrong.append(f"{page.relative_to(ROOT)}: matexrun {flag} ({line.strip()})")
            line = re.sub(r"python3? -m matex(?=\.)", "", line)   # python -m matex.timeline
            for flag in _command_flags(line, "-m matex", lambda flag: False):
                checked += 1
                if flag not in python_m_matex:
                    wrong.append(f"{page.relative_to(ROOT)}: python -m matex {flag}")
    assert not wrong, "flags the code does not have:\n" + "\n".join(wrong)
    assert checked > 40, checked


def _registered() -> dict:
    sys.path.insert(0, str(ROOT))
    from matex import _config

    return _config.VARIABLES


def _variables_in(text: str) -> set[str]:
    return set(re.findall(r"MATEX_[A-Z0-9_]+", text))


def _unknown(names: set[str], registry) -> set[str]:
    """Names not in ``registry``; ``MATEX_STALL_*`` (a prefix) must start a registered one."""
    return {n for n in names if n not in registry
            and not (n.endswith("_") and any(r.startswith(n) for r in registry))}


def test_every_documented_variable_is_registered():
    registry = _registered()
    for page in _pages():
        unknown = _unknown(_variables_in(page.read_text(encoding="utf-8")), registry)
        assert not unknown, f"{page.relative_to(ROOT)} names unregistered {sorted(unknown)}"


def test_every_variable_the_code_reads_is_registered():
    # a MATEX_* name anywhere in the Python and shell code is in matex._config.VARIABLES
    # (C++ macros in tf_ops/ and Python constants named MATEX_* are not variables)
    registry = _registered()
    macros = set()                      # C++ macros (a Python comment may name one)
    for path in (ROOT / "tf_ops").glob("**/*"):
        if path.is_file() and path.suffix in (".h", ".cc"):
            macros |= set(re.findall(r"#define\s+(MATEX_[A-Z0-9_]+)",
                                     path.read_text(encoding="utf-8", errors="replace")))
    for folder in ("matex", "readers", "benchmarks", "examples", "tests", "docker"):
        for path in sorted((ROOT / folder).glob("**/*")):
            if path.suffix not in (".py", ".sh", "") or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            constants = set(re.findall(r"^\s*(MATEX_[A-Z0-9_]+)\s*=", text, re.M))
            unknown = _unknown(_variables_in(text) - constants - macros, registry)
            assert not unknown, f"{path.relative_to(ROOT)} reads unregistered {sorted(unknown)}"


def _module_names(dotted: str, depth: int = 0) -> set[str] | None:
    """The names module ``dotted`` defines or exports (AST, no import), or None when it is
    not a MaTEx module."""
    path = _module_file(dotted)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree) if depth == 0 else tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            for target in targets:
                if getattr(target, "id", "") in ("__all__", "_LAZY") and node.value is not None:
                    for const in ast.walk(node.value):
                        if isinstance(const, ast.Constant) and isinstance(const.value, str):
                            names.add(const.value)
                    if isinstance(node.value, ast.Attribute) and node.value.attr == "OPTIONAL":
                        names |= _optional_names(dotted)
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")}
        names |= {p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()}
    return names


def _optional_names(dotted: str) -> set[str]:
    """``_api.OPTIONAL``'s candidates (the Horovod collectives MaTEx may have)."""
    source = (ROOT / "matex" / "horovod" / "_api.py").read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "OPTIONAL":
            return {c.value for c in ast.walk(node.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return set()


def _resolves(dotted: str) -> bool:
    """Whether ``matex.a.b...`` names a module, or a name defined in or exported by one (a
    class's attribute when the class is defined there); deeper parts are not checked."""
    parts = dotted.split(".")
    module = parts[0]
    for i, part in enumerate(parts[1:], 1):
        if _module_file(module + "." + part) is not None:
            module += "." + part
            continue
        names = _module_names(module)
        return names is None or part in names
    return True


_HVD_MODULES = ("matex.horovod.tensorflow", "matex.horovod.tensorflow.keras",
                "matex.horovod.keras")


def test_every_named_matex_and_hvd_name_resolves():
    hvd = set().union(*(_module_names(m, depth=1) for m in _HVD_MODULES))
    wrong, checked = [], 0
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"\]\([^)]*\)|https?://\S+", "", text)     # link targets, URLs
        for name in set(re.findall(r"(?<![\w./\"'-])matex(?:\.[A-Za-z_]\w*)+", text)):
            if "X" in name.split("."):     # a placeholder: `matex.X`
                continue
            checked += 1
            if not _resolves(name):
                wrong.append(f"{page.relative_to(ROOT)}: {name}")
        for name in set(re.findall(r"(?<![\w.])hvd\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?",
                                   text)):
            first, second = name
            if first == "X":                # a placeholder: `hvd.X`
                continue
            checked += 1
            if first not in hvd:
                wrong.append(f"{page.relative_to(ROOT)}: hvd.{first}")
            elif second and first in ("elastic", "callbacks"):
                inner = set().union(*(_module_names(m + "." + first, depth=1) or set()
                                      for m in _HVD_MODULES))
                if second not in inner:
                    wrong.append(f"{page.relative_to(ROOT)}: hvd.{first}.{second}")
    assert not wrong, "names the code does not have:\n" + "\n".join(sorted(wrong))
    assert checked > 100, checked


_BENCHMARK_COMMAND = re.compile(r"(benchmarks/\w+\.py)((?:\s+-[^\s`]*(?:\s+[^-\s`][^\s`]*)?)*)")


def test_every_named_script_exists():
    # benchmark and example commands name files that exist; `python -m matex.X` a runnable
    # module (a module file, or a package with __main__.py)
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for module in set(re.findall(r"python3? -m (matex\.[\w.]+)", text)):
            path = _module_file(module)
            runnable = path is not None and (path.name != "__init__.py"
                                             or (path.parent / "__main__.py").is_file())
            assert runnable, f"{page.relative_to(ROOT)}: python -m {module}"
        # a benchmark command's flags are the driver's (or its shared _common.py's)
        for line in _code(text):
            for script, rest in _BENCHMARK_COMMAND.findall(line):
                if not (ROOT / script).is_file():
                    continue
                source = (ROOT / script).read_text(encoding="utf-8") + \
                    (ROOT / "benchmarks" / "_common.py").read_text(encoding="utf-8")
                for flag in re.findall(r"(?<!\S)(--[\w-]+)", rest):
                    assert f'"{flag}"' in source, f"{page.relative_to(ROOT)}: {script} {flag}"
        for target in set(re.findall(r"(?<![\w/])((?:benchmarks|examples)/[\w/.-]+\.(?:py|sh))",
                                     text)):
            assert (ROOT / target).is_file(), f"{page.relative_to(ROOT)} names {target}"


def test_an_unregistered_variable_cannot_be_read():
    sys.path.insert(0, str(ROOT))
    from matex import _config

    name = "MATEX_" + "NOT_REGISTERED"      # spelled apart: the scan above must not see it
    with pytest.raises(KeyError, match=name):
        _config._get(name)
    assert all(v.scope in ("user", "matexrun", "internal", "tests") and v.meaning
               for v in _config.VARIABLES.values())
