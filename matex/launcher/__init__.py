"""The ``matexrun`` launcher (``python -m matex.launcher``), one concern per module.

* ``cli``: arguments and ``main``, the launch plan;
* ``mpiexec``: which mpiexec, its MPI flavour, its command line and
  environment, ULFM's flags, transient start-up failures;
* ``hosts``: ``-H`` host lists, hostfiles, Slurm allocations, their mpiexec
  arguments;
* ``supervise``: the job under ``--ft`` (ranks' failure reports in a status
  directory) and ``--restart``; launches that failed to start retried.
"""

from matex.launcher.cli import main
from matex.launcher.hosts import (FORWARDED_PREFIXES, HostError, SlurmAllocation,
                                  cluster_mpi_args, expand_counts, expand_hostlist,
                                  format_hostfile, forwarded_env, parse_hosts, read_hostfile,
                                  slurm_allocation, total_slots)
from matex.launcher.mpiexec import (DEFAULT_HEARTBEAT, find_mpiexec, ft_mpi_args, launch_env,
                                    mpi_flavor, mpiexec_command, startup_failed)
from matex.launcher.supervise import (STATUS_DIR_VAR, failed_ranks, report_failure,
                                      run_captured, run_fault_tolerant, run_with_restarts,
                                      status_directory)

__all__ = [
    "DEFAULT_HEARTBEAT",
    "FORWARDED_PREFIXES",
    "STATUS_DIR_VAR",
    "HostError",
    "SlurmAllocation",
    "cluster_mpi_args",
    "expand_counts",
    "expand_hostlist",
    "failed_ranks",
    "find_mpiexec",
    "format_hostfile",
    "forwarded_env",
    "ft_mpi_args",
    "launch_env",
    "main",
    "mpi_flavor",
    "mpiexec_command",
    "parse_hosts",
    "read_hostfile",
    "report_failure",
    "run_captured",
    "run_fault_tolerant",
    "run_with_restarts",
    "slurm_allocation",
    "startup_failed",
    "status_directory",
    "total_slots",
]
