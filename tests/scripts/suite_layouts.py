"""Run pytest suites of tests/mpi at several rank counts in one MPI job.

Usage (under mpiexec): suite_layouts.py REPORT_DIR LAYOUTS FILE... [-- LAYOUTS FILE...]...

LAYOUTS is ``;``-separated layouts, each a ``,``-separated list of group sizes
(``4;3,1;2``: the whole world of 4, then groups of 3 and 1 side by side, then
ranks 0-1 as one group while the others wait). For every layout, each group's
ranks run the suites on a sub-communicator installed as MaTEx's (as the
resilience layer installs one after a shrink), so ``matex.rank()``,
``matex.size()`` and ``matex.comm()`` are the group's; each group reports into
REPORT_DIR/<layout index>-<group index>/rank<world rank>.xml
(``mpitools.check_reports`` reads them), and the group's rank 0 writes there
group.json: the size and world ranks of the communicator the suites ran on.
Stanzas after ``--`` run other files on their own layouts, in order (a suite
that must come after another in a process, as ``matex.keras``'s patch of
Keras requires, goes in a later stanza); layout indices count on across them.
Each rank starts Python, TensorFlow and MaTEx once for all layouts, instead of
once per rank count.
"""

import json
import os
import sys
import time

import pytest
from mpi4py import MPI

import matex
from matex import _runtime

MPI_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi")


def _forget_suite_modules():
    """Drop the suites' modules (test files, conftest, helpers), imported on the
    previous layout's communicator: their module-level rank and size must be read again."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if os.path.dirname(os.path.abspath(path)) == MPI_DIR:
            del sys.modules[name]


def _wait_for_all(comm):
    """A barrier that sleeps: ranks done early leave the CPU to the groups still running."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def main():
    report_dir, stanzas = sys.argv[1], [[]]
    for arg in sys.argv[2:]:
        if arg == "--":
            stanzas.append([])
        else:
            stanzas[-1].append(arg)
    runs = [(layout, stanza[1:]) for stanza in stanzas for layout in stanza[0].split(";")]
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    matex.comm()   # MaTEx's own communicators, before any is replaced
    failed = 0
    for index, (layout, files) in enumerate(runs):
        sizes = [int(s) for s in layout.split(",")]
        assert sum(sizes) <= world.Get_size(), layout
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        group = next((g for g, start in enumerate(starts) if start <= rank < start + sizes[g]),
                     None)
        restore = matex.comm().Dup()
        sub = matex.comm().Split(MPI.UNDEFINED if group is None else group, rank)
        if group is not None:
            _runtime._set_comm(sub)
            os.environ["MATEX_TEST_REPORT_DIR"] = os.path.join(report_dir,
                                                               "%d-%d" % (index, group))
            os.makedirs(os.environ["MATEX_TEST_REPORT_DIR"], exist_ok=True)
            _forget_suite_modules()
            code = pytest.main(["-q", "-p", "no:cacheprovider",
                                "-c", os.path.join(MPI_DIR, "pytest.ini")]
                               + [os.path.join(MPI_DIR, f) for f in files])
            failed |= int(code) != 0
            ranks = matex.comm().allgather(rank)   # the group, as the suites saw it
            if matex.rank() == 0:
                with open(os.path.join(os.environ["MATEX_TEST_REPORT_DIR"], "group.json"),
                          "w") as f:
                    json.dump({"size": matex.size(), "world_ranks": ranks}, f)
        _wait_for_all(world)
        # collective over the whole world (ranks outside a group too); frees the group's
        _runtime._set_comm(restore)
    sys.stdout.flush()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
