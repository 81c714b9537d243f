"""``matexrun --check`` / ``python -m matex --check``: is this installation right?

One line per item (TensorFlow, Keras, the MPI library, its thread level,
ULFM, the C++ compiler, the build cache of MaTEx's ops, ``mpiexec``, the
optional extras), each marked ``ok``, ``info``, ``warn`` or ``FAIL``; a
warning or a failure is followed by its fix. The exit status is 1 when an
item failed (MaTEx cannot run as installed), else 0. Horovod users know the
idea as ``horovodrun --check-build``.

Nothing is built unless ``--build`` is given and no rank is started: MPI is
initialised once, as a singleton, to read the thread level it provides, after
every subprocess this check runs (forking after ``MPI_Init`` is unsafe on
RDMA fabrics).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
ULFM_SYMBOLS = ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree",
                "MPIX_Comm_failure_ack")
EXTRAS = (("keras-tuner", "keras_tuner", "matex.hpo with Keras Tuner"),
          ("scipy", "scipy", "matex.hpo's Bayesian oracle, matex.science"),
          ("matplotlib", "matplotlib", "matex.science's plots"))


@dataclass
class Item:
    """One line of the report: what was checked, how it stands, what was found, the fix."""

    name: str
    status: str
    found: str
    fix: str = ""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _range_text(low: tuple[int, int], high: tuple[int, int]) -> str:
    return "%d.%d" % low if low == high else "%d.%d-%d.%d" % (low + high)


def check_tensorflow() -> Item:
    """TensorFlow's version against the tested range, its distribution(s), the GPUs it sees."""
    from matex import _compat

    try:
        import tensorflow as tf
    except ImportError as exc:
        return Item("TensorFlow", FAIL, "not importable (%s)" % exc,
                    "pip install 'matex[cpu]' (tensorflow-cpu), or tensorflow / your "
                    "site's TensorFlow module, version >= %d.%d" % _compat.TESTED_TENSORFLOW[0])
    dists = sorted({name.replace("_", "-").lower()
                    for name, _ in _compat.tensorflow_distributions()})
    build = "CUDA build" if tf.test.is_built_with_cuda() else "CPU-only build"
    gpus = [d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices("GPU")]
    found = "%s (%s, %s), GPUs: %s" % (tf.__version__, ", ".join(dists) or "distribution unknown",
                                       build, ", ".join(gpus) or "none")
    low, high = _compat.TESTED_TENSORFLOW
    version = _version_tuple(tf.__version__)
    if version < low:
        return Item("TensorFlow", FAIL, found,
                    "MaTEx needs TensorFlow >= %d.%d: pip install -U tensorflow (or "
                    "tensorflow-cpu, whichever this environment uses)" % low)
    if len(dists) > 1:
        return Item("TensorFlow", WARN, found,
                    "several distributions install the same 'tensorflow' package and shadow "
                    "each other: pip uninstall the one(s) you do not want, then reinstall "
                    "the other (pip install --force-reinstall %s)" % dists[0])
    if build == "CUDA build" and not gpus:
        return Item("TensorFlow", WARN, found,
                    "a CUDA build that sees no GPU: check CUDA_VISIBLE_DEVICES and the driver "
                    "(nvidia-smi), or run on a GPU node")
    if version > high:
        return Item("TensorFlow", WARN, found + "; tested %s" % _range_text(low, high),
                    "newer than MaTEx was tested with: run tests/test_compat.py, or pin "
                    "tensorflow==%d.%d.*" % high)
    return Item("TensorFlow", OK, found)


def check_keras() -> Item:
    """Keras's version against ``_compat.TESTED_KERAS`` and the private names MaTEx patches."""
    from matex import _compat

    try:
        import keras
    except ImportError as exc:
        return Item("Keras", FAIL, "not importable (%s)" % exc, "pip install 'keras>=3.15'")
    low, high = _compat.TESTED_KERAS
    found = "%s (tested %s)" % (keras.__version__, _range_text(low, high))
    try:
        importlib.import_module("keras_tuner")
        tuner = True
    except ImportError:
        tuner = False
    missing = [name for name in _compat.check() if tuner or not name.startswith("keras_tuner")]
    if missing:
        return Item("Keras", FAIL, found + "; missing internals: " + ", ".join(missing),
                    "MaTEx patches these Keras/Keras Tuner internals: install the tested "
                    "versions (pip install 'keras==%d.%d.*' 'keras-tuner==%d.%d.*')"
                    % (high + _compat.TESTED_KERAS_TUNER[1]))
    if not low <= _version_tuple(keras.__version__) <= high:
        return Item("Keras", WARN, found,
                    "outside the tested range (every internal MaTEx uses is present): run "
                    "tests/test_compat.py, or pip install 'keras==%d.%d.*'" % high)
    return Item("Keras", OK, found)


class _Mpi:
    """What is known of the MPI library mpi4py loads, without initialising it."""

    def __init__(self) -> None:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False   # initialised at the end, after every fork
            mpi4py.rc.finalize = False
        from mpi4py import MPI

        from matex import _build

        self.MPI = MPI
        self.text = MPI.Get_library_version().replace("\x00", "").strip()
        self.first_line = self.text.splitlines()[0] if self.text else "unknown"
        self.standard = "%d.%d" % MPI.Get_version()
        self.libmpi = _build._loaded_libmpi()
        self.prefix = os.path.dirname(os.path.dirname(self.libmpi))
        self.version = _build._library_version()   # ("Open MPI", "5.0"), or None
        self.flavor = None
        if self.version is not None:
            self.flavor = ("openmpi" if self.version[0] == "Open MPI" else "mpich",
                           int(self.version[1].split(".")[0]))
        self.full_version = None
        found = re.search(r"(?:Open MPI v|MPICH Version:\s*)(\d+(?:\.\d+)+)", self.text)
        if found:
            self.full_version = found.group(1)

    def describe(self) -> str:
        return "%s %s" % (self.version[0], self.full_version or self.version[1]) \
            if self.version else self.first_line


def check_mpi_library(mpi: _Mpi) -> Item:
    """The MPI library mpi4py loaded: its identity, the libmpi file, the MPI standard."""
    return Item("MPI library", OK, "%s; %s; MPI standard %s; mpi4py %s"
                % (mpi.first_line, mpi.libmpi, mpi.standard, _installed("mpi4py") or "?"))


def _ompi_info(mpi: _Mpi) -> str | None:
    """``ompi_info``'s output for the library's own Open MPI, or None."""
    exe = shutil.which("ompi_info", path=os.path.join(mpi.prefix, "bin"))
    if exe is None:
        return None
    try:
        return subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def check_ulfm(mpi: _Mpi) -> Item:
    """Whether ULFM fault tolerance can work: mpi4py's API, the library's MPIX_ symbols,
    Open MPI's "FT MPI support"."""
    api = hasattr(mpi.MPI.Comm, "Shrink") and hasattr(mpi.MPI.Comm, "Get_failed")
    lib = ctypes.CDLL(mpi.libmpi)
    symbols = [s for s in ULFM_SYMBOLS if hasattr(lib, s)]
    built = None
    if mpi.flavor and mpi.flavor[0] == "openmpi":
        info = _ompi_info(mpi)
        found = re.search(r"FT MPI support:\s*(\w+)", info or "")
        built = found.group(1) == "yes" if found else None
    facts = ["mpi4py API %s" % ("yes" if api else "no"),
             "%d/%d MPIX_ symbols" % (len(symbols), len(ULFM_SYMBOLS))]
    if built is not None:
        facts.append("Open MPI FT MPI support: %s" % ("yes" if built else "no"))
    if api and len(symbols) == len(ULFM_SYMBOLS) and built is not False:
        return Item("ULFM", OK, "available (%s); active only under matexrun --ft "
                    "(mpiexec --with-ft ulfm)" % ", ".join(facts))
    return Item("ULFM", WARN, "not available (%s)" % ", ".join(facts),
                "fault tolerance (matexrun --ft) needs an MPI with ULFM: Open MPI 5 "
                "(pip install 'matex[mpi]' brings one; build option --with-ft=ulfm) or "
                "MPICH 4 with ULFM, and mpi4py >= 4; without it matexrun --restart is the "
                "fallback")


def check_compiler() -> tuple[Item, str | None]:
    """The C++ compiler the ops build with (``CXX``, else g++/c++ on PATH) and its version."""
    from matex import _build

    try:
        cxx = _build._compiler()
    except _build.BuildError as exc:
        return Item("compiler", FAIL, "none usable: MaTEx's ops cannot be built or loaded",
                    str(exc)), None
    try:
        version = _build._cached_compiler_version(cxx)
    except OSError as exc:
        return Item("compiler", FAIL, "%s does not run (%s)" % (cxx, exc),
                    "set CXX to a working C++17 compiler (g++ >= 9, clang++ >= 10)"), None
    source = "CXX" if os.environ.get("CXX") else "PATH"
    return Item("compiler", OK, "%s (from %s): %s" % (cxx, source, version)), cxx


def check_ops(mpi: _Mpi, build: bool) -> list[Item]:
    """Whether the op libraries for this TensorFlow/MPI/compiler are in the build cache."""
    from matex import _build

    try:
        import tensorflow as tf
    except ImportError:
        return [Item("ops", FAIL, "cannot tell: TensorFlow is missing", "install TensorFlow")]
    pair = "TensorFlow %s + %s" % (tf.__version__, mpi.describe())
    items = []
    try:
        if build:
            _build.tf_ops_dir()
            _build.csvparse_dir()
        ops, parser = _build.tf_ops_dir(build=False), _build.csvparse_dir(build=False)
    except _build.BuildError as exc:
        return [Item("ops", FAIL, "cannot be built for %s" % pair, str(exc))]
    if ops is not None:
        items.append(Item("ops", OK, "built for %s (warm cache): %s" % (pair, ops)))
    else:
        items.append(Item("ops", INFO, "not built yet for %s (cold cache under %s)"
                          % (pair, _build.build_root()),
                          "they build on first use (2.5 min here on 2 busy cores), or now: "
                          "matexrun --check --build"))
    if parser is None:
        items.append(Item("CSV parser", INFO, "not built yet (cold cache)",
                          "builds on first use of a CSV reader, or now: matexrun --check --build"))
    return items


def _mpiexec_identity(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "does not run (%s)" % exc
    lines = (out.stdout + out.stderr).strip().splitlines()
    return lines[0].strip() if lines else "no --version output"


def _compare_mpiexec(mpi: _Mpi, path: str) -> tuple[bool | None, str]:
    """``(matches, description)`` of an mpiexec against mpi4py's library (None: cannot tell)."""
    from matex.launcher.mpiexec import mpi_flavor

    flavor = mpi_flavor(path)
    same_prefix = os.path.dirname(os.path.dirname(os.path.realpath(path))) == \
        os.path.realpath(mpi.prefix)
    text = "%s: %s%s" % (path, _mpiexec_identity(path),
                         " (same installation as libmpi)" if same_prefix else "")
    if mpi.flavor is None or flavor[0] == "unknown":
        return (True if same_prefix else None), text
    if flavor[0] != mpi.flavor[0] or (flavor[1] is not None and flavor[1] != mpi.flavor[1]):
        return False, text
    return True, text


def check_mpiexec(mpi: _Mpi) -> list[Item]:
    """The mpiexec matexrun would use, and the one on PATH, against mpi4py's MPI library."""
    from matex import _config
    from matex.launcher.mpiexec import find_mpiexec

    try:
        chosen = find_mpiexec()
    except SystemExit as exc:
        return [Item("mpiexec", FAIL, "none found", str(exc))]
    via = " (MATEX_MPIEXEC)" if _config.mpiexec() else ""
    if shutil.which(chosen) is None:
        return [Item("mpiexec", FAIL, "matexrun uses%s %s, which is no executable" % (via, chosen),
                     "set MATEX_MPIEXEC to the mpiexec of %s (%s/bin/mpiexec), or unset it"
                     % (mpi.libmpi, mpi.prefix))]
    matches, text = _compare_mpiexec(mpi, chosen)
    if matches is False:
        fix = ("matexrun would start the ranks with another MPI than the library mpi4py "
               "loaded (%s, %s): they would fail in MPI_Init or run as separate singletons. "
               % (mpi.describe(), mpi.libmpi))
        fix += ("Unset MATEX_MPIEXEC or set it to that library's mpiexec (%s/bin/mpiexec)"
                % mpi.prefix if via else
                "Install mpiexec next to %s, or set MATEX_MPIEXEC to it" % mpi.libmpi)
        items = [Item("mpiexec", FAIL, "matexrun uses%s %s" % (via, text), fix)]
    elif matches is None:
        items = [Item("mpiexec", WARN, "matexrun uses%s %s" % (via, text),
                      "cannot tell whether it belongs to %s; if ranks fail in MPI_Init, set "
                      "MATEX_MPIEXEC to the mpiexec of that library" % mpi.libmpi)]
    else:
        items = [Item("mpiexec", OK, "matexrun uses%s %s, matches %s"
                      % (via, text, mpi.describe()))]
    on_path = shutil.which("mpiexec")
    if on_path is None:
        items.append(Item("mpiexec on PATH", INFO, "none (matexrun finds its own)"))
    elif os.path.realpath(on_path) != os.path.realpath(chosen):
        matches, text = _compare_mpiexec(mpi, on_path)
        if matches is False:
            items.append(Item("mpiexec on PATH", WARN, text + ", not " + mpi.describe(),
                              "a hand-typed `mpiexec -n N python ...` would start ranks of "
                              "another MPI: launch with matexrun, or put %s first on PATH"
                              % os.path.dirname(chosen)))
        else:
            items.append(Item("mpiexec on PATH", OK, text))
    return items


def check_thread_level(mpi: _Mpi) -> Item:
    """The thread level MPI provides against MPI_THREAD_MULTIPLE, which MaTEx needs.

    Initialises MPI (a singleton) unless it already is, and finalises it again.
    """
    import mpi4py

    from matex import _runtime

    MPI = mpi.MPI
    names = {getattr(MPI, "THREAD_" + n): "MPI_THREAD_" + n
             for n in ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")}
    requested = str(mpi4py.rc.thread_level).upper()
    required = getattr(MPI, "THREAD_" + requested, MPI.THREAD_MULTIPLE)
    started = False
    if not MPI.Is_initialized():
        MPI.Init_thread(required)
        started = True
    try:
        provided = MPI.Query_thread()
        found = "provides %s; MaTEx needs MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level=%r)" % (
            names.get(provided, provided), mpi4py.rc.thread_level)
        try:
            _runtime._require_thread_multiple(MPI)
        except RuntimeError as exc:
            return Item("thread level", FAIL, found, str(exc).replace("matex: ", "", 1))
        return Item("thread level", OK, found)
    finally:
        if started:
            MPI.Finalize()


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_extras() -> Item:
    """The optional packages (keras-tuner, scipy, matplotlib): present or not; informational."""
    found = []
    for dist, _module, what in EXTRAS:
        version = _installed(dist)
        found.append("%s %s" % (dist, version) if version else "%s absent (%s)" % (dist, what))
    return Item("extras", INFO, "; ".join(found))


def _guard(name: str, fn: Callable[[], Item | list[Item]]) -> list[Item]:
    """``fn()``'s items; an unexpected exception becomes a failed item naming it."""
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a check that breaks is itself a finding
        return [Item(name, FAIL, "check failed: %s: %s" % (type(exc).__name__, exc),
                     "report this with the output of matexrun --check")]
    return result if isinstance(result, list) else [result]


def collect(build: bool = False) -> list[Item]:
    """Every item, in report order. Subprocesses first, MPI initialised last."""
    from matex import _quiet

    _quiet.quiet_tensorflow_startup()   # TensorFlow's start-up notices are no finding
    items = {}
    items["tf"] = _guard("TensorFlow", check_tensorflow)
    items["keras"] = _guard("Keras", check_keras)
    mpi = None
    try:
        mpi = _Mpi()
    except Exception as exc:  # noqa: BLE001 - no MPI: every MPI item fails with this
        items["mpi"] = [Item("MPI library", FAIL, "%s: %s" % (type(exc).__name__, exc),
                             "pip install mpi4py and an MPI (pip install 'matex[mpi]', or your "
                             "site's MPI module before pip install --no-binary mpi4py mpi4py)")]
    if mpi is not None:
        items["mpi"] = _guard("MPI library", lambda: check_mpi_library(mpi))
        items["ulfm"] = _guard("ULFM", lambda: check_ulfm(mpi))
    compiler = _guard("compiler", lambda: check_compiler()[0])
    items["cxx"] = compiler
    if mpi is not None and compiler[0].status != FAIL:
        items["ops"] = _guard("ops", lambda: check_ops(mpi, build))
    if mpi is not None:
        items["mpiexec"] = _guard("mpiexec", lambda: check_mpiexec(mpi))
        items["thread"] = _guard("thread level", lambda: check_thread_level(mpi))
    items["extras"] = _guard("extras", check_extras)
    order = ("tf", "keras", "mpi", "thread", "ulfm", "cxx", "ops", "mpiexec", "extras")
    return [item for key in order for item in items.get(key, [])]


def report(items: Sequence[Item], out: TextIO) -> int:
    """Print the table (and each fix under its item); return the exit status."""
    from matex._version import __version__

    width = max(len(item.name) for item in items)
    print("MaTEx %s self-check (Python %s, %s)" % (
        __version__, sys.version.split()[0], sys.executable), file=out)
    for item in items:
        print("  %-4s  %-*s  %s" % (item.status, width, item.name, item.found), file=out)
        if item.fix and item.status in (WARN, FAIL, INFO):
            print("  %-4s  %-*s  fix: %s" % ("", width, "", item.fix), file=out)
    failed = [item.name for item in items if item.status == FAIL]
    warned = [item.name for item in items if item.status == WARN]
    if failed:
        print("FAILED: %s (see the fix under each)" % ", ".join(failed), file=out)
        return 1
    print("OK" + (" with warnings: %s" % ", ".join(warned) if warned else ""), file=out)
    return 0


def main(build: bool = False, out: TextIO | None = None) -> int:
    """Run every check, print the report on ``out`` (stdout), return the exit status."""
    started = time.monotonic()
    out = out or sys.stdout
    items = collect(build)
    code = report(items, out)
    print("(checked in %.1f s)" % (time.monotonic() - started), file=out, flush=True)
    return code
