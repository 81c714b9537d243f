"""The documentation site builds with warnings as errors, its API reference comes from
the docstrings, and the README stays a front page (issue #26, part 3)."""

import html
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
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + proc.stdout + proc.stderr
    return out


def test_api_reference_is_generated_from_the_docstrings(site):
    # the first line of each docstring, as written in the source, must be on its API page
    from matex._optimizer import DistributedOptimizer
    from matex.errors import RankFailure
    from matex.hpo._minimize import minimize

    for page, obj in (("matex", DistributedOptimizer), ("errors", RankFailure), ("hpo", minimize)):
        first = " ".join(obj.__doc__.strip().splitlines()[0].replace("``", "").split())
        text = _text(site / "api" / page / "index.html")
        assert obj.__name__ in text, page
        # compared without whitespace: tags around ``code`` split words differently
        assert "".join(first.split()) in "".join(text.split()), (page, first)


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
