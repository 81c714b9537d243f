"""Building the op library: clear errors, rebuild keys, no fork after MPI_Init."""

import json
import os
import subprocess
import sys

import mpitools

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


FAKE_CXX = """#!/bin/sh
# a C++ compiler that names itself VERSION (and is g++ otherwise)
if [ "$1" = --version ]; then echo "fake c++ VERSION"; exit 0; fi
exec g++ "$@"
"""


def test_a_changed_compiler_selects_a_fresh_build_and_is_probed_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MATEX_BUILD_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_build_into", lambda target, products, build: target)
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(FAKE_CXX.replace("VERSION", "1.0"))
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    first = _build.core_dir()

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a subprocess ran for a probed compiler/MPI: %s" % (args,))

    # Same compiler and MPI: the answers come from the build root, nothing runs,
    # in this process and in a new one (whose in-process memo is empty).
    with monkeypatch.context() as patched:
        patched.setattr(_build.subprocess, "run", no_subprocess)
        assert _build.core_dir() == first
        patched.setattr(_build, "_probed", {})
        assert _build.core_dir() == first
    # The compiler changes (an upgrade in place): a new build.
    cxx.write_text(FAKE_CXX.replace("VERSION", "2.0.1"))
    second = _build.core_dir()
    assert second != first
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "probes").iterdir()) == [
        "cxx", "cxx", "mpiinc"]


def test_probe_runs_once_per_inputs_and_again_when_invalid(tmp_path, monkeypatch):
    monkeypatch.setenv("MATEX_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_probed", {})
    calls = []

    def compute():
        calls.append(1)
        return "answer %d" % len(calls)

    assert _build._probe("t", ("a", 1), compute) == "answer 1"
    monkeypatch.setattr(_build, "_probed", {})          # as in a new process
    assert _build._probe("t", ("a", 1), compute) == "answer 1" and len(calls) == 1
    assert _build._probe("t", ("a", 2), compute) == "answer 2"
    assert _build._probe("t", ("a", 1), compute, lambda value: False) == "answer 3"


def test_probe_in_a_build_root_that_cannot_be_written(tmp_path, monkeypatch):
    # A shared read-only install (e.g. the Docker image's, built as another user)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MATEX_BUILD_DIR", str(blocker / "build"))
    monkeypatch.setattr(_build, "_probed", {})
    assert _build._probe("t", ("ro",), lambda: "computed") == "computed"


NO_FORK_SCRIPT = """
import json, os, subprocess, sys
# TensorFlow first: its import runs `uname -p` (h5py asks platform.uname() for the
# processor), which is TensorFlow's fork, not MaTEx's.
import numpy as np
import tensorflow as tf
import mpi4py.MPI  # MPI_Init: from here on, forking is what RDMA fabrics do not survive
import _posixsubprocess

forks = []


def refuse(name):
    def refused(*args, **kwargs):
        forks.append("%s %r" % (name, args[:2]))
        raise RuntimeError("%s after MPI_Init" % name)
    return refused


subprocess.Popen = refuse("subprocess.Popen")
_posixsubprocess.fork_exec = refuse("_posixsubprocess.fork_exec")
for name in ("fork", "forkpty", "vfork", "posix_spawn", "posix_spawnp", "system", "popen",
             "execv", "execve", "execvp", "execvpe", "spawnv", "spawnve"):
    if hasattr(os, name):
        setattr(os, name, refuse("os." + name))

import matex

total = matex.allreduce(np.full(3, matex.rank() + 1.0, np.float32), op="sum")
print(json.dumps({"rank": matex.rank(), "sum": [float(x) for x in np.asarray(total)],
                  "forks": forks}), flush=True)
"""


def test_warm_build_loads_the_ops_without_forking_after_mpi_init(tmp_path):
    # Warm build (and probe answers) first, as a job's ranks find it after
    # `python -m matex._build` or an earlier run.
    warm = subprocess.run([sys.executable, "-m", "matex._build"], capture_output=True,
                          text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr[-3000:]
    script = tmp_path / "no_fork.py"
    script.write_text(NO_FORK_SCRIPT)
    proc = mpitools.run_mpi(2, [sys.executable, str(script)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reports = sorted((json.loads(line) for line in proc.stdout.splitlines()
                      if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1], proc.stdout
    for report in reports:
        assert report["forks"] == [], report
        assert report["sum"] == [3.0, 3.0, 3.0]


def test_cray_ibm_and_mpich_c_libraries_are_recognised_bindings_are_not(tmp_path):
    """Cray MPICH (libmpi_cray, libmpi_gnu_123), IBM Spectrum (libmpi_ibm) and MPICH's
    libmpich are MPI C libraries; Open MPI's Fortran/C++ bindings beside libmpi are not.
    Before, only libmpi.so* was: on a Cray nothing built."""
    names = {"libmpi_cray.so.12.0.0": True, "libmpi_gnu_123.so.12": True,
             "libmpi_intel_2021.so.12": True, "libmpi_ibm.so.3": True, "libmpich.so.12": True,
             "libmpi.so.40.30.0": True, "libmpi.so": True, "libmpi_mpifh.so.40": False,
             "libmpi_usempif08.so.40": False, "libmpi_cxx.so.40": False,
             "libmpichcxx.so.12": False, "libmpifort.so.12": False, "libmpi_java.so": False}
    lines = []
    for name, expected in names.items():
        path = tmp_path / name
        path.write_bytes(b"")
        assert _build.is_mpi_library(str(path)) is expected, name
        lines.append("7f00-7f01 r-xp 00000000 00:00 1    %s\n" % path)
    lines.append("7f00-7f01 rw-p 00000000 00:00 0    [heap]\n")
    assert _build.mapped_libmpis(lines) == sorted(
        str(tmp_path / n) for n, ok in names.items() if ok)
