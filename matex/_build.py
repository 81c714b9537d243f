"""Compile MaTEx's C++ libraries against the TensorFlow and the MPI in use.

Three shared objects come out of ``tf_ops/``:

* ``libmatex_core.so``: the MPI collectives (no TensorFlow, no Python),
* ``_matex_core*.so``: the pybind11 module over the core,
* ``matex_tf_ops.so``: the TensorFlow ops over the core;

and one out of ``readers/``: ``_matex_csvparse*.so``, the readers' CSV
parser (a pybind11 module, no MPI, no TensorFlow).

Each lands in a directory named after a hash of everything it depends on
(sources, compiler, MPI library and headers, Python, TensorFlow), so a change
of TensorFlow or of MPI selects a new directory and triggers a rebuild. A file
lock makes concurrently starting ranks build once.

Two inputs come from subprocesses: the compiler's ``--version`` and the MPI
include directory (``mpicc -showme``). The ops load after ``MPI_Init``, where
forking is unsafe on RDMA fabrics (registered memory) and slow at scale, so
those answers are kept in ``<build root>/probes/``, keyed by what is known
without running anything (paths, sizes and modification times of the
compiler, of ``libmpi`` and of the ``mpicc`` wrappers; the MPI library's
version string): on a warm build nothing forks.

Run ``python -m matex._build`` to build ahead of time.
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from matex import _atomic, _config, _state


class BuildError(RuntimeError):
    """The op library cannot be built; the message names what is missing."""


def _source_dir():
    here = Path(__file__).resolve().parent
    for candidate in (here / "tf_ops", here.parent / "tf_ops"):
        if (candidate / "core" / "matex_core.h").is_file():
            return candidate
    raise BuildError(
        "MaTEx's C++ sources (tf_ops/) are missing next to %s; reinstall matex" % here
    )


def build_root():
    """Directory under which the compiled libraries are cached."""
    root = _config.build_dir()
    if root:
        return Path(root)
    return Path(sys.prefix) / "share" / "matex" / "build"


def _compiler():
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(
        "no C++ compiler found (looked for %s). Install one (Debian/Ubuntu: "
        "apt-get install g++) or set CXX to its path." % ", ".join(names)
    )


# The C library of an MPI implementation, by file name: Open MPI and MPICH's libmpi (and
# MPICH's libmpich), Cray MPICH's libmpi_cray and per-compiler libmpi_gnu_123 / _intel_... /
# _nvidia_..., IBM Spectrum MPI's libmpi_ibm. Not the language bindings beside them
# (libmpi_cxx, libmpi_mpifh, libmpi_usempif08, libmpi_java, libmpichcxx, libmpifort).
_MPI_LIBRARY = re.compile(
    r"^lib(?:mpi|mpich|mpi_cray|mpi_ibm|mpi_(?:gnu|intel|nvidia|pgi|aocc|amd|cray|crayclang)"
    r"(?:_\w+)?)\.so(?:\.[\d.]+)?$")


def is_mpi_library(path: str) -> bool:
    """Whether ``path`` names an MPI implementation's C library (see ``_MPI_LIBRARY``)."""
    return bool(_MPI_LIBRARY.match(os.path.basename(path)))


def _mapped_files(maps_lines=None) -> set:
    """Paths of the files mapped into this process (``/proc/self/maps``, or the given
    lines)."""
    if maps_lines is None:
        with open("/proc/self/maps") as maps:
            maps_lines = maps.readlines()
    return {name for name in (line.rsplit(None, 1)[-1] for line in maps_lines if line.strip())
            if "/" in name}


def mapped_libmpis(maps_lines=None) -> list:
    """Real paths of every MPI C library mapped into this process (``/proc/self/maps``,
    or the given lines), sorted."""
    return sorted({os.path.realpath(name) for name in _mapped_files(maps_lines)
                   if is_mpi_library(name)})


def _mapped_mpi_like(maps_lines=None) -> list:
    """Mapped files whose name holds ``mpi`` (for the error when none is recognised)."""
    return sorted(n for n in _mapped_files(maps_lines)
                  if "mpi" in os.path.basename(n).lower() and ".so" in n and "mpi4py" not in n)


def _loaded_libmpi():
    """Real path of the libmpi that mpi4py loaded into this process."""
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    libs = mapped_libmpis()
    if not libs:
        near = _mapped_mpi_like()
        raise BuildError(
            "mpi4py is imported but no MPI library this build knows is mapped in this process "
            "(it looks for libmpi.so, libmpich.so, Cray's libmpi_cray.so / libmpi_gnu_*.so and "
            "IBM's libmpi_ibm.so). Mapped files with 'mpi' in their name: %s. If one of them is "
            "your MPI's C library, please report its name; mpi4py itself may be built against "
            "another MPI than the one you load (pip install --no-binary mpi4py mpi4py)."
            % (", ".join(near) or "none"))
    if len(libs) > 1:
        raise BuildError("several MPI libraries are loaded at once: %s" % ", ".join(libs))
    return libs[0]


def _header_version(header):
    """``("Open MPI", "4.1")`` or ``("MPICH", "4.0")`` declared by an mpi.h, or None."""
    import re

    text = Path(header).read_text(errors="replace")
    major = re.search(r"#define\s+OMPI_MAJOR_VERSION\s+(\d+)", text)
    minor = re.search(r"#define\s+OMPI_MINOR_VERSION\s+(\d+)", text)
    if major and minor:
        return ("Open MPI", "%s.%s" % (major.group(1), minor.group(1)))
    mpich = re.search(r'#define\s+MPICH_VERSION\s+"(\d+\.\d+)', text)
    if mpich:
        return ("MPICH", mpich.group(1))
    return None


def _library_version():
    """``("Open MPI", "5.0")``, ``("MPICH", "4.0")``... of the MPI mpi4py loaded, or None."""
    import re

    from mpi4py import MPI

    text = MPI.Get_library_version()
    found = re.search(r"Open MPI v(\d+\.\d+)", text)
    if found:
        return ("Open MPI", found.group(1))
    found = re.search(r"MPICH Version:\s*(\d+\.\d+)", text)
    if found:
        return ("MPICH", found.group(1))
    return None


def _mpi_include_places(libmpi):
    """``(explicit, candidate include dirs, mpicc wrappers)`` for ``libmpi``; no subprocess."""
    libdir = Path(libmpi).resolve().parent
    prefix = libdir.parent
    explicit = _config.mpi_include()
    candidates = [explicit] if explicit else []
    candidates += [str(prefix / "include"), str(prefix / "include" / "openmpi"),
                   str(libdir / "openmpi" / "include"),      # Debian/Ubuntu multiarch
                   str(libdir / "mpich" / "include")]
    # the compiler wrapper of that MPI first; one found on PATH may be another MPI's
    wrappers = [shutil.which("mpicc", path=str(d))
                for d in (prefix / "bin", prefix.parent / "bin")]
    wrappers.append(shutil.which("mpicc"))
    return explicit, candidates, list(dict.fromkeys(w for w in wrappers if w))


def _mpi_include_dir(libmpi):
    """Include directory whose mpi.h belongs to ``libmpi`` (the MPI mpi4py loaded).

    Runs the MPI's ``mpicc`` wrappers; ``_cached_mpi_include_dir`` runs them once.
    """
    explicit, candidates, wrappers = _mpi_include_places(libmpi)
    for exe in wrappers:
        for args in (["-showme:incdirs"], ["-show"]):
            try:
                out = subprocess.run([exe] + args, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                continue
            for tok in out.stdout.split():
                if args == ["-show"]:
                    if tok.startswith("-I"):
                        candidates.append(tok[2:])
                else:
                    candidates.append(tok)
    library = _library_version()
    seen = []
    for inc in dict.fromkeys(candidates):
        header = os.path.join(inc, "mpi.h")
        if not os.path.isfile(header):
            continue
        declared = _header_version(header)
        if explicit and inc == explicit:
            return inc                       # the user's word
        if library is None or declared is None or declared == library:
            return inc
        seen.append("%s (%s %s)" % (header, declared[0], declared[1]))
    if seen:
        raise BuildError(
            "no mpi.h matching the MPI library mpi4py loaded (%s, %s %s): found only %s. "
            "Set MATEX_MPI_INCLUDE to that MPI's include directory, or put its mpicc first "
            "on PATH." % (libmpi, library[0], library[1], ", ".join(seen)))
    raise BuildError(
        "mpi.h not found for the MPI library %s (looked in %s). Set MATEX_MPI_INCLUDE "
        "to the include directory of that MPI, or install its development package."
        % (libmpi, ", ".join(dict.fromkeys(candidates)))
    )


def _python_include():
    inc = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(inc, "Python.h")):
        raise BuildError(
            "Python.h not found in %s: install the Python development headers "
            "(Debian/Ubuntu: apt-get install python3-dev)" % inc
        )
    return inc


def _pybind11_include():
    try:
        import pybind11
    except ImportError:
        raise BuildError("pybind11 is not installed: pip install pybind11") from None
    return pybind11.get_include(), pybind11.__version__


def _hash(*parts):
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _tree_digest(directory):
    return [(str(p.relative_to(directory)), p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.suffix in (".h", ".cc")]


def _compiler_version(cxx):
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def _file_key(path):
    """A file's identity without reading or running it: path, real path, size, mtime."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return (str(path), real, None, None)
    return (str(path), real, st.st_size, st.st_mtime_ns)


_probed = _state.table("build.probed", lifetime="process")   # probe file path -> value


def _probe(name, inputs, compute, still_valid=lambda value: True):
    """``compute()`` (which runs a subprocess) once per ``inputs``, kept in the build root.

    ``inputs`` must determine the answer and be known without a subprocess.
    A kept answer that fails ``still_valid`` is computed again. A build root
    that cannot be written (a shared, read-only install) only costs the cache.
    """
    filename = "%s-%s.json" % (name, _hash(inputs))
    path = build_root() / "probes" / filename

    def kept():
        value = _probed.get(str(path))
        if value is None:
            try:
                value = json.loads(path.read_text())["value"]
            except (OSError, ValueError, KeyError, TypeError):
                return None
        return value if value is not None and still_valid(value) else None

    value = kept()
    if value is None:
        with _Locked(build_root() / ".lock", optional=True):
            value = kept()
            if value is None:
                value = compute()
                try:
                    _atomic.write(path, json.dumps({"inputs": repr(inputs), "value": value}),
                                  mkdir=True)
                except OSError:
                    pass   # read-only build root: the answer is not kept
    _probed[str(path)] = value
    return value


def _cached_compiler_version(cxx):
    """``cxx --version``'s first line, run once per compiler binary (see ``_probe``)."""
    return _probe("cxx", _file_key(cxx), lambda: _compiler_version(cxx))


def _cached_mpi_include_dir(libmpi):
    """``_mpi_include_dir(libmpi)``, its wrappers run once per MPI (see ``_probe``)."""
    from mpi4py import MPI

    explicit, candidates, wrappers = _mpi_include_places(libmpi)
    inputs = (_file_key(libmpi), MPI.Get_library_version(), explicit,
              [_file_key(w) for w in wrappers],
              [_file_key(os.path.join(c, "mpi.h")) for c in candidates])
    return _probe("mpiinc", inputs, lambda: _mpi_include_dir(libmpi),
                  lambda inc: os.path.isfile(os.path.join(inc, "mpi.h")))


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            "compiling MaTEx's C++ code failed:\n  %s\n%s"
            % (" ".join(cmd), (proc.stderr or proc.stdout)[-4000:])
        )


def _compile_and_link(cxx, flags, sources, output, link):
    """Build ``output`` from ``sources``: one object per source, compiled on every usable
    core, then linked with ``flags + link``; the objects are removed afterwards.

    ``g++ a.cc b.cc`` compiles its files one after the other; separate objects
    give the same library.
    """
    output = Path(output)
    sources = [Path(s) for s in sources]
    objects = [output.parent / ("%s-%d.o" % (s.stem, i)) for i, s in enumerate(sources)]
    workers = max(1, min(len(sources), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda so: _run([cxx] + flags + ["-c", str(so[0]), "-o", str(so[1])]),
                      zip(sources, objects)))
    _run([cxx] + flags + [str(o) for o in objects] + ["-o", str(output)] + link)
    for obj in objects:
        obj.unlink()


class _Locked:
    """Exclusive lock on a file, so that one process builds and the others wait.

    ``optional``: go on unlocked where the lock file cannot be opened (a
    read-only build root).
    """

    def __init__(self, path, optional=False):
        self.path = path
        self.optional = optional
        self.fd = None

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            if not self.optional:
                raise
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _built(target, products):
    """``target`` if it holds every one of ``products``, else None."""
    return target if all((target / p).is_file() for p in products) else None


def _build_into(target, products, build):
    """Run ``build(tmpdir)`` unless ``target`` already holds ``products``."""
    if all((target / p).is_file() for p in products):
        return target
    with _Locked(target.parent / ".lock"):
        if all((target / p).is_file() for p in products):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


_OPT = ["-O3", "-fPIC", "-shared", "-pthread", "-Wall", "-Wno-sign-compare"]
# the C API only: Open MPI 4's and MPICH's mpi.h otherwise pull in their C++
# bindings under a C++ compiler (undefined MPI::... symbols at load time)
_MPI_DEFINES = ["-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1"]


def _say(msg):
    print("matex: " + msg, file=sys.stderr, flush=True)


def core_dir(build=True):
    """Build (if needed) the core and its pybind11 module; return their directory.

    ``build=False`` only looks (``matexrun --check``): None when not built yet.
    """
    src = _source_dir()
    cxx = _compiler()
    libmpi = _loaded_libmpi()
    mpi_inc = _cached_mpi_include_dir(libmpi)
    py_inc = _python_include()
    pb_inc, pb_version = _pybind11_include()
    from mpi4py import MPI

    ext = sysconfig.get_config_var("EXT_SUFFIX")
    key = _hash(_tree_digest(src / "core"), _tree_digest(src / "python"),
                _cached_compiler_version(cxx), libmpi, MPI.Get_library_version(),
                (Path(mpi_inc) / "mpi.h").read_bytes(), sys.version, ext,
                pb_version, _OPT, _MPI_DEFINES)
    target = build_root() / ("core-" + key)
    products = ["libmatex_core.so", "_matex_core" + ext]

    def compile_core(tmp):
        started = time.time()
        _say("building the MPI core against %s (one time)..." % libmpi)
        abi = "-D_GLIBCXX_USE_CXX11_ABI=1"
        core_flags = ["-std=c++17", abi] + _OPT + _MPI_DEFINES + ["-I" + mpi_inc]
        _compile_and_link(cxx, core_flags, sorted((src / "core").glob("*.cc")),
                          tmp / "libmatex_core.so",
                          ["-Wl,-soname,libmatex_core.so", libmpi,
                           "-Wl,-rpath," + os.path.dirname(libmpi)])
        _run([cxx, "-std=c++17", abi, "-fvisibility=hidden"] + _OPT + [
            "-I" + str(src / "core"), "-I" + pb_inc, "-I" + py_inc,
            str(src / "python" / "bindings.cc"), "-o", str(tmp / products[1]),
            "-L" + str(tmp), "-lmatex_core", "-Wl,-rpath,$ORIGIN"])
        _say("core built in %.1f s" % (time.time() - started))

    if not build:
        return _built(target, products)
    return _build_into(target, products, compile_core)


def tf_ops_dir(build=True):
    """Build (if needed) the TensorFlow op library; return its directory.

    ``build=False`` only looks (``matexrun --check``): None when not built yet.
    """
    import tensorflow as tf

    if int(getattr(tf.sysconfig, "CXX11_ABI_FLAG", 1)) != 1:
        raise BuildError(
            "this TensorFlow was built with the pre-C++11 string ABI, which MaTEx's "
            "core does not support; use a TensorFlow wheel from PyPI (2.9 or newer)"
        )
    core = core_dir(build)
    if core is None:
        return None
    src = _source_dir()
    cxx = _compiler()
    cflags = tf.sysconfig.get_compile_flags()
    lflags = tf.sysconfig.get_link_flags()
    key = _hash(core.name, _tree_digest(src / "kernels"), tf.__version__,
                tf.sysconfig.get_include(), cflags, lflags)
    target = build_root() / ("tfops-" + key)

    def compile_ops(tmp):
        started = time.time()
        _say("building the TensorFlow %s ops (one time, ~20 s)..." % tf.__version__)
        flags = _OPT + cflags + ["-I" + str(src / "core")]
        _compile_and_link(cxx, flags, sorted((src / "kernels").glob("*.cc")),
                          tmp / "matex_tf_ops.so",
                          ["-L" + str(core), "-lmatex_core", "-Wl,-rpath," + str(core)] + lflags)
        _say("ops built in %.1f s" % (time.time() - started))

    if not build:
        return _built(target, ["matex_tf_ops.so"])
    return _build_into(target, ["matex_tf_ops.so"], compile_ops)


def _readers_source():
    """readers/_csvparse.cc: next to matex/ in a source tree, matex/readers/ when installed."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "readers", here.parent / "readers"):
        if (candidate / "_csvparse.cc").is_file():
            return candidate / "_csvparse.cc"
    raise BuildError("the CSV parser's source (readers/_csvparse.cc) is missing next to %s; "
                     "reinstall matex" % here)


def csvparse_dir(build=True):
    """Build (if needed) the readers' native CSV parser (no MPI, no TensorFlow); its directory.

    ``build=False`` only looks (``matexrun --check``): None when not built yet.

    One pybind11 module, ``_matex_csvparse``, keyed like the core by its
    source, the compiler, Python and pybind11.
    """
    source = _readers_source()
    cxx = _compiler()
    py_inc = _python_include()
    pb_inc, pb_version = _pybind11_include()
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    flags = ["-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=1", "-fvisibility=hidden"] + _OPT
    key = _hash(source.read_bytes(), _cached_compiler_version(cxx), sys.version, ext, pb_version,
                flags)
    target = build_root() / ("csvparse-" + key)
    product = "_matex_csvparse" + ext

    def compile_parser(tmp):
        started = time.time()
        _say("building the native CSV parser (one time)...")
        _run([cxx] + flags + ["-I" + pb_inc, "-I" + py_inc, str(source),
                              "-o", str(tmp / product)])
        _say("CSV parser built in %.1f s" % (time.time() - started))

    if not build:
        return _built(target, [product])
    return _build_into(target, [product], compile_parser)


if __name__ == "__main__":
    print(tf_ops_dir() / "matex_tf_ops.so")
    print(csvparse_dir() / ("_matex_csvparse" + sysconfig.get_config_var("EXT_SUFFIX")))
