"""MPI start per rank: Open MPI's default transports against MaTEx's on one node.

    python benchmarks/mpi_start.py            # 5 rounds
    python benchmarks/mpi_start.py --quick    # 2 rounds

On one node ``import matex`` sets ``OMPI_MCA_btl=^ofi`` before MPI starts
(``matex._cpu.set_mpi_transports``): Open MPI's libfabric byte transport finds
nothing a node's own ranks need and is closed again after a one-second sleep.
Variants, alternating, each a 2-rank ``mpiexec`` job with no ``OMPI_MCA_btl`` of
its own:

- ``open-mpi``: ``from mpi4py import MPI`` (Open MPI's default transports): the
  reference;
- ``matex``: ``import matex`` then ``from mpi4py import MPI``.

Figures: the slower rank's seconds from the first import to MPI running (median
over rounds), the whole job's wall time, and each against ``open-mpi``.
"""

import os
import statistics
import time

import _common

VARIANTS = ("open-mpi", "matex")
RANKS = 2


def worker(variant):
    """Start MPI as ``variant`` does; rank 0 emits the slower rank's seconds."""
    started = time.perf_counter()
    if variant == "matex":
        import matex  # noqa: F401 - sets the one-node transports before MPI starts
    from mpi4py import MPI

    seconds = MPI.COMM_WORLD.allreduce(time.perf_counter() - started, MPI.MAX)
    _common.emit({"start_s": seconds, "btl": os.environ.get("OMPI_MCA_btl", "")},
                 MPI.COMM_WORLD.Get_rank())


def run(variant):
    """One job; (rank 0's result, the job's wall seconds). MPI starts in the worker, after
    its imports; the driver's own ``import matex`` set variables the job must not get."""
    started = time.perf_counter()
    result = _common.run_phase(__file__, variant, RANKS, timeout=300, mpi4py_runner=False,
                               unset=("OMPI_MCA_btl", "MATEX_MPI_BTL_SET"))
    return result, time.perf_counter() - started


def main():
    args = _common.parse_args(__doc__.splitlines()[0], list(VARIANTS), repeats=5)
    if args.worker:
        return worker(args.worker)
    rounds = 2 if args.quick and args.repeats == 1 else args.repeats
    runs = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            runs[variant].append(run(variant))
    results = {variant: {"start_s": statistics.median(r["start_s"] for r, _ in done),
                         "job_s": statistics.median(wall for _, wall in done),
                         "btl": done[0][0]["btl"]}
               for variant, done in runs.items()}
    reference = results["open-mpi"]
    rows = [[variant, result["btl"] or "(Open MPI's default)",
             "%.3f" % result["start_s"], "%.2f" % (result["start_s"] / reference["start_s"]),
             "%.2f" % result["job_s"], "%.2f" % (result["job_s"] / reference["job_s"])]
            for variant, result in results.items()]
    print(_common.header("MPI start per rank on one node: Open MPI's transports and MaTEx's",
                         "python benchmarks/mpi_start.py" + (" --quick" if args.quick else "")))
    print(_common.table(["variant", "OMPI_MCA_btl", "start (s)", "x open-mpi",
                         "job (s)", "x open-mpi"], rows))
    print("\n%d ranks, median of %d rounds, variants alternating." % (RANKS, rounds))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
