"""Building the op library: clear errors, rebuild keys."""

import os
import subprocess
import sys

from matex import _build

CODE = "from matex import _build; _build.core_dir()"


def _run(env):
    return subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def test_missing_compiler_is_one_clear_error(tmp_path):
    proc = _run({"CXX": "/nonexistent/g++", "MATEX_BUILD_DIR": str(tmp_path)})
    assert proc.returncode != 0
    assert "no C++ compiler found" in proc.stderr and "/nonexistent/g++" in proc.stderr


def test_missing_mpi_header_is_named(tmp_path):
    code = ("import os; from matex import _build; _build._mpi_include_dir("
            "'/nowhere/lib/libmpi.so.40')")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    # no mpi.h at all, or only another MPI's (e.g. a system Open MPI on PATH)
    assert ("mpi.h not found" in proc.stderr or "no mpi.h matching" in proc.stderr), proc.stderr
    assert "MATEX_MPI_INCLUDE" in proc.stderr


def test_a_different_mpi_library_selects_a_fresh_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MATEX_BUILD_DIR", str(tmp_path / "cache"))
    first = _build.core_dir()
    assert (first / "libmatex_core.so").is_file() and first.parent == tmp_path / "cache"
    assert _build.core_dir() == first            # cached: same inputs, same build
    # Another MPI library (here: the same file reached through another path,
    # as after switching module or venv) must not reuse the old build.
    libmpi = _build._loaded_libmpi()
    other = tmp_path / "other-mpi" / "lib"
    other.mkdir(parents=True)
    (other / os.path.basename(libmpi)).symlink_to(libmpi)
    (tmp_path / "other-mpi" / "include").symlink_to(
        _build._mpi_include_dir(libmpi), target_is_directory=True)
    monkeypatch.setattr(_build, "_loaded_libmpi", lambda: str(other / os.path.basename(libmpi)))
    second = _build.core_dir()
    assert second != first and (second / "libmatex_core.so").is_file()


def test_compiler_error_shows_command_and_output(tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++")
    try:
        _build._run(["g++", "-c", str(bad), "-o", str(tmp_path / "bad.o")])
    except _build.BuildError as exc:
        assert "bad.cc" in str(exc) and "compiling MaTEx's C++ code failed" in str(exc)
    else:
        raise AssertionError("a broken source compiled")
