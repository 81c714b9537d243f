"""``python -m matex script.py [args]``: run a script as its own ``__main__``.

``sys.argv``, ``__name__ == "__main__"`` and exit codes behave as when the
script runs alone. An uncaught exception on any rank prints its traceback and
aborts the whole MPI job, so the other ranks do not hang in a collective.
"""

import os
import runpy
import sys
import traceback


def _run(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m matex script.py [args...]", file=sys.stderr)
        return 2
    script = argv[0]
    if not os.path.isfile(script):
        print("matex: no such script: %s" % script, file=sys.stderr)
        return 2
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - any failure must end the whole job
        _abort_job()
    return 0


def _abort_job():
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    text = traceback.format_exc()
    sys.stderr.write("".join("[rank %d] %s\n" % (rank, line) for line in text.splitlines()))
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
