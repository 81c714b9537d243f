"""``matexrun --check`` and ``python -m matex --check`` (``matex._check``): the installation
self-check reports what this environment really has, and fails with the fix when it is broken."""

import ctypes
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

from matex import _check, _compat

BIN = os.path.dirname(sys.executable)
LINE = re.compile(r"^  (ok|info|warn|FAIL)\s+(\S.*?)\s{2,}(\S.*)$")
FIX = re.compile(r"^\s+fix: (.*)$")


def _parse(stdout):
    """``{name: (status, found, fix)}`` from the report's table."""
    items, last = {}, None
    for line in stdout.splitlines():
        fix = FIX.match(line)
        if fix and last:
            items[last] = items[last][:2] + (fix.group(1),)
            continue
        found = LINE.match(line)
        if found:
            last = found.group(2)
            items[last] = (found.group(1), found.group(3), "")
    return items


def _other_mpiexec(directory, library_text):
    """A fake ``mpiexec`` of another MPI than ``library_text``'s (its --version only)."""
    other = ("HYDRA build details:\n    Version:                                 4.2.0"
             if "Open MPI" in library_text else "mpiexec (OpenRTE) 4.1.4")
    path = directory / "mpiexec"
    path.write_text("#!/bin/sh\ncat <<'EOF'\n%s\nEOF\n" % other)
    path.chmod(0o755)
    return str(path)


def _expected():
    """What the check must find, computed here."""
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    from matex import _build
    from matex.launcher.mpiexec import find_mpiexec

    libmpi = _build._loaded_libmpi()
    return {
        "tf": tf.__version__, "keras": keras.__version__,
        "mpi": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "libmpi": libmpi, "standard": "MPI standard %d.%d" % MPI.Get_version(),
        "ulfm": all(hasattr(ctypes.CDLL(libmpi), s) for s in _check.ULFM_SYMBOLS),
        "cxx": shutil.which("g++") or shutil.which("c++"),   # CXX is unset in the run
        "ops": _build.tf_ops_dir(build=False), "mpiexec": find_mpiexec(),
    }


def test_matexrun_check_reports_this_installation(tmp_path):
    expected = _expected()
    fake = _other_mpiexec(tmp_path, expected["mpi"])
    env = dict(os.environ, PATH=str(tmp_path) + os.pathsep + os.environ["PATH"])
    env.pop("MATEX_MPIEXEC", None)
    env.pop("CXX", None)
    proc = subprocess.run([os.path.join(BIN, "matexrun"), "--check"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    items = _parse(proc.stdout)
    assert items["TensorFlow"][0] == "ok" and items["TensorFlow"][1].startswith(
        expected["tf"] + " ("), items["TensorFlow"]
    flavour = sorted(n.replace("_", "-").lower()
                     for n in importlib.metadata.packages_distributions()["tensorflow"])
    assert "(%s," % ", ".join(flavour) in items["TensorFlow"][1]
    assert "GPUs: none" in items["TensorFlow"][1] or "GPU:0" in items["TensorFlow"][1]
    tested = _check._range_text(*_compat.TESTED_KERAS)   # "3.15"
    assert items["Keras"] == ("ok", "%s (tested %s)" % (expected["keras"], tested), "")
    status, found, _ = items["MPI library"]
    assert status == "ok" and found.startswith(expected["mpi"] + "; " + expected["libmpi"])
    assert expected["standard"] in found
    assert items["thread level"][:2] == ("ok", "provides MPI_THREAD_MULTIPLE; MaTEx needs "
                                         "MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level="
                                         "'multiple')")
    assert items["ULFM"][0] == ("ok" if expected["ulfm"] else "warn")
    assert items["compiler"][0] == "ok"
    assert items["compiler"][1].startswith(expected["cxx"] + " (from PATH): ")
    if expected["ops"] is not None:
        assert items["ops"][0] == "ok"
        assert items["ops"][1].startswith("built for TensorFlow %s + " % expected["tf"])
        assert items["ops"][1].endswith(" (warm cache): %s" % expected["ops"])
    else:
        assert items["ops"][0] == "info" and "matexrun --check --build" in items["ops"][2]
    assert items["mpiexec"][0] == "ok"
    assert items["mpiexec"][1].startswith("matexrun uses %s: " % expected["mpiexec"])
    # the mpiexec first on PATH is another MPI's: a warning, and how to avoid it
    status, found, fix = items["mpiexec on PATH"]
    assert status == "warn" and found.startswith(fake + ": ") and "not " in found
    assert "launch with matexrun, or put %s first on PATH" % os.path.dirname(
        expected["mpiexec"]) in fix
    extras = items["extras"][1]
    for dist in ("keras-tuner", "scipy", "matplotlib"):
        try:
            assert "%s %s" % (dist, importlib.metadata.version(dist)) in extras
        except importlib.metadata.PackageNotFoundError:
            assert "%s absent" % dist in extras
    assert proc.stdout.splitlines()[-2] == "OK with warnings: mpiexec on PATH"
    seconds = float(re.search(r"checked in ([\d.]+) s", proc.stdout).group(1))
    assert seconds < 60, proc.stdout   # ~7 s here (2 cores, shared)


def test_python_m_matex_check_fails_with_the_fix_for_a_missing_compiler_and_a_foreign_mpiexec(
        tmp_path):
    from mpi4py import MPI

    fake = _other_mpiexec(tmp_path, MPI.Get_library_version())
    env = dict(os.environ, CXX="/nonexistent/c++", MATEX_MPIEXEC=fake)
    proc = subprocess.run([sys.executable, "-m", "matex", "--check"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    items = _parse(proc.stdout)
    status, found, fix = items["compiler"]
    assert status == "FAIL" and "cannot be built" in found
    assert fix.startswith("no C++ compiler found (looked for /nonexistent/c++)")
    assert "set CXX to its path" in fix
    status, found, fix = items["mpiexec"]
    assert status == "FAIL" and found.startswith("matexrun uses (MATEX_MPIEXEC) %s: " % fake)
    assert "another MPI than the library mpi4py loaded" in fix
    assert "Unset MATEX_MPIEXEC or set it to that library's mpiexec" in fix
    # what is not broken is still reported as such
    assert items["TensorFlow"][0] == "ok" and items["MPI library"][0] == "ok"
    assert "ops" not in items   # nothing to say about a build that cannot happen
    assert proc.stdout.splitlines()[-2] == \
        "FAILED: compiler, mpiexec (see the fix under each)"


def test_a_thread_level_below_multiple_fails_with_the_fix():
    fake = types.SimpleNamespace(THREAD_SINGLE=0, THREAD_FUNNELED=1, THREAD_SERIALIZED=2,
                                 THREAD_MULTIPLE=3, Is_initialized=lambda: True,
                                 Query_thread=lambda: 1)
    item = _check.check_thread_level(types.SimpleNamespace(MPI=fake))
    assert item.status == "FAIL"
    assert item.found.startswith("provides MPI_THREAD_FUNNELED; MaTEx needs MPI_THREAD_MULTIPLE")
    assert "MPICH_MAX_THREAD_SAFETY=multiple" in item.fix


@pytest.mark.parametrize("argv, message", [
    (["--build"], "--build goes with --check"),
    (["--check", "train.py"], "--check runs no script (got train.py)"),
    ([], "the following arguments are required: script (or -m MODULE, or --check)"),
])
def test_matexrun_check_flags_are_checked(argv, message, capsys, monkeypatch):
    import mpi4py

    from matex.launcher.cli import main

    monkeypatch.setattr(mpi4py.rc, "initialize", mpi4py.rc.initialize)   # main() sets it

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_cold_build_cache_is_reported_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("MATEX_BUILD_DIR", str(tmp_path))
    items = _check.check_ops(_check._Mpi(), build=False)
    assert [(i.name, i.status) for i in items] == [("ops", "info"), ("CSV parser", "info")]
    assert items[0].found.startswith("not built yet for TensorFlow ")
    assert items[0].found.endswith("(cold cache under %s)" % tmp_path)
    assert "matexrun --check --build" in items[0].fix
    assert not list(tmp_path.glob("core-*")) and not list(tmp_path.glob("tfops-*"))  # looked only


def test_an_mpiexec_that_does_not_exist_fails_with_the_fix(monkeypatch):
    monkeypatch.setenv("MATEX_MPIEXEC", "/nonexistent/mpiexec")
    mpi = _check._Mpi()
    items = _check.check_mpiexec(mpi)
    assert [(i.name, i.status) for i in items] == [("mpiexec", "FAIL")]
    assert items[0].found == "matexrun uses (MATEX_MPIEXEC) /nonexistent/mpiexec, which is no " \
                            "executable"
    assert items[0].fix == "set MATEX_MPIEXEC to the mpiexec of %s (%s/bin/mpiexec), or unset it" \
        % (mpi.libmpi, mpi.prefix)


def test_two_distributions_of_tensorflow_are_a_warning_with_the_fix(monkeypatch):
    import tensorflow as tf

    both = [("tensorflow-cpu", tf.__version__), ("tensorflow", tf.__version__)]
    monkeypatch.setattr(_compat, "tensorflow_distributions", lambda: both)
    item = _check.check_tensorflow()
    assert item.status == "warn"
    assert item.found.startswith("%s (tensorflow, tensorflow-cpu, " % tf.__version__)
    assert "several distributions install the same 'tensorflow' package" in item.fix
    assert "pip uninstall the one(s) you do not want" in item.fix
