"""``matexrun``: launch a script on N ranks with the right ``mpiexec`` and flags.

    matexrun -n 4 train.py --epochs 3
    matexrun -v -n 2 train.py        # print the mpiexec command it runs

It picks the ``mpiexec`` of the MPI that mpi4py uses, adds
``--oversubscribe`` when there are more ranks than cores, and sets Open MPI's
run-as-root variables when running as root. The script runs under
``python -m matex`` so an unmodified TensorFlow/Keras script is distributed.

Beyond one machine (see docs/hpc.md):

    matexrun -H node1:2,node2:2 train.py          # 4 ranks, 2 per host
    matexrun --hostfile hosts.txt -n 8 train.py
    matexrun train.py                             # inside a Slurm allocation:
                                                  # hosts and -n from SLURM_*
    matexrun --dry-run ...                        # print the command, run nothing
    matexrun --check                              # check the installation (no script)
    matexrun -n 2 -m pytest -q test_x.py          # a module, as python -m runs it
    matexrun --horovod -np 2 train_hvd.py         # an unmodified Horovod script
    matexrun --elastic --host-discovery-script ./hosts.sh train.py
                                                  # restart on the hosts left when a
                                                  # whole host is lost (docs/fault-tolerance.md)

``--horovod`` makes ``import horovod...`` resolve to ``matex.horovod`` in every
rank. horovodrun's common flags are accepted: ``-np``, ``-H``, ``--hostfile``,
``--timeline-filename FILE`` (one merged timeline written to FILE),
``--fusion-threshold-mb N`` (``MATEX_FUSION_THRESHOLD``), ``--network-interface``
(``--tcp-if``), ``--start-timeout`` (``MATEX_START_TIMEOUT``), ``--check-build``
(``--check``); flags that mean nothing with MaTEx (``--gloo``, ``--cycle-time-ms``,
``--autotune``...) are accepted and named once, as ignored.

In a Slurm allocation (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` set) and
without ``-H``/``--hostfile``, the allocation's nodes and tasks per node
become a hostfile and ``-n`` defaults to ``SLURM_NTASKS``; ``--no-slurm``
turns that off. ``mpiexec`` (not ``srun``) starts the ranks, as ULFM fault
tolerance needs Open MPI's own runtime.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from matex.launcher.hosts import (HostError, cluster_mpi_args, format_hostfile, parse_hosts,
                                  read_hostfile, slurm_allocation, total_slots)
from matex.launcher.mpiexec import (DEFAULT_HEARTBEAT, find_mpiexec, ft_mpi_args, launch_env,
                                    mpi_flavor, mpiexec_command)
from matex.launcher.supervise import (DISCOVERY_POLL_S, STATUS_DIR_VAR, discover_hosts,
                                      run_fault_tolerant, run_with_restarts)


def _add_cluster_options(parser):
    group = parser.add_argument_group(
        "beyond one machine", "hosts from -H, --hostfile or the Slurm allocation (docs/hpc.md)")
    group.add_argument("-H", "--host", dest="hosts", action="append", default=[],
                       metavar="HOST[:SLOTS],...",
                       help="hosts and ranks per host, e.g. node1:2,node2:2 (repeatable; "
                            "-n defaults to the sum of slots, a host without slots counts 1)")
    group.add_argument("--hostfile", metavar="FILE",
                       help="hostfile ('HOST slots=N' or 'HOST:N' lines); -n defaults to "
                            "the sum of slots")
    group.add_argument("--slurm", dest="slurm", action="store_true", default=None,
                       help="use the Slurm allocation (default: when SLURM_JOB_ID and "
                            "SLURM_JOB_NODELIST are set and no -H/--hostfile is given)")
    group.add_argument("--no-slurm", dest="slurm", action="store_false",
                       help="ignore SLURM_* variables")
    group.add_argument("--launch-agent", metavar="CMD",
                       help="command that replaces ssh to start MPI's daemons on other "
                            "hosts (Open MPI: plm_ssh_agent; MPICH: -launcher-exec)")
    group.add_argument("--tcp-if", metavar="IF|CIDR[,...]",
                       help="network interfaces or subnets MPI's TCP traffic must use, "
                            "e.g. ib0 or 10.1.0.0/16")
    group.add_argument("--dry-run", action="store_true",
                       help="print the mpiexec command (and generated hostfile), run nothing")


def _plan_cluster(opts, parser, env, mpiexec):
    """Hosts of the run: ``(nranks, mpi_args, hostfile_text, notes)``.

    ``hostfile_text`` is set when a hostfile must be written (Slurm); its
    path is then the ``--hostfile``/``-f`` argument that follows in
    ``mpi_args`` as the placeholder ``{hostfile}``.
    """
    hosts = []
    for spec in opts.hosts:
        try:
            hosts += parse_hosts(spec)
        except HostError as exc:
            parser.error(str(exc))
    listed = None
    if opts.hostfile:
        if not os.path.isfile(opts.hostfile):
            parser.error("no such hostfile: %s" % opts.hostfile)
        try:
            listed = read_hostfile(opts.hostfile)
        except HostError as exc:
            parser.error(str(exc))
    notes, cpus_per_task, hostfile_text, hostfile = [], 1, None, opts.hostfile
    slurm = None
    if opts.slurm is not False:
        try:
            slurm = slurm_allocation(env)
        except (HostError, ValueError) as exc:
            parser.error("cannot read the Slurm allocation: %s" % exc)
        if opts.slurm and slurm is None:
            parser.error("--slurm: not in a Slurm allocation (SLURM_JOB_ID and "
                         "SLURM_JOB_NODELIST are not set)")
        if slurm is not None and (hosts or listed) and not opts.slurm:
            notes.append("Slurm job %s ignored: hosts given with -H/--hostfile" % slurm.job_id)
            slurm = None
        elif slurm is not None and (hosts or listed):
            parser.error("--slurm cannot be combined with -H/--hostfile")
    if slurm is not None:
        hosts = []
        hostfile = "{hostfile}"
        hostfile_text = format_hostfile(slurm.hosts, mpi_flavor(mpiexec)[0])
        cpus_per_task = slurm.cpus_per_task
        notes.append("Slurm job %s: %d node(s), %d task(s), %d cpu(s) per task" % (
            slurm.job_id, len(slurm.hosts), slurm.ntasks, slurm.cpus_per_task))
        steps = env.get("SLURM_STEP_NUM_TASKS", "")
        if env.get("SLURM_STEP_ID") and steps.isdigit() and int(steps) > 1:
            notes.append("warning: matexrun runs in a Slurm step of %s tasks, so %s mpiexec "
                         "jobs start; run matexrun once, in the batch script (not under srun)"
                         % (steps, steps))
    cluster = bool(hosts or listed or slurm)
    if opts.nranks is None:
        if slurm is not None:
            opts.nranks = slurm.ntasks
        elif hosts or listed:
            opts.nranks = total_slots(hosts + (listed or []))
        else:
            opts.nranks = 1
    if not cluster and not (opts.launch_agent or opts.tcp_if):
        return opts.nranks, [], None, notes
    args = cluster_mpi_args(mpiexec, hosts=hosts, hostfile=hostfile,
                            launch_agent=opts.launch_agent, tcp_if=opts.tcp_if,
                            cpus_per_task=cpus_per_task, env=env if cluster else None)
    if cpus_per_task > 1:
        env.setdefault("OMP_NUM_THREADS", str(cpus_per_task))
        if mpi_flavor(mpiexec)[0] != "mpich" and "OMP_NUM_THREADS" not in args:
            args += ["-x", "OMP_NUM_THREADS"]
    return opts.nranks, args, hostfile_text, notes


def _status_parent(opts, parser, cluster_args):
    """Where ``--ft``'s status directory goes: ``--status-dir``; on one machine the
    temporary directory (None); on several hosts the current directory, which they
    are expected to share (as the venv and the script)."""
    parent = opts.status_dir or (os.getcwd() if cluster_args else None)
    if parent is not None and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
        parser.error("--ft reports rank failures in a directory of %s, which is not a "
                     "writable directory; choose one every host sees with --status-dir"
                     % parent)
    return parent


def _ignore_signal(signum, frame):
    pass


# horovodrun's flags that mean nothing with MaTEx: flag -> (takes a value, why)
HOROVODRUN_IGNORED = {
    "--gloo": (False, "MaTEx's collectives are MPI only"),
    "--mpi": (False, "MaTEx always uses MPI"),
    "--jsrun": (False, "ranks start with mpiexec"),
    "--tcp": (False, "MPI picks the transport (restrict it with --tcp-if)"),
    "--cycle-time-ms": (True, "MaTEx has no background cycle: collectives run when issued"),
    "--cache-capacity": (True, "MaTEx has no response cache"),
    "--disable-cache": (False, "MaTEx has no response cache"),
    "--hierarchical-allreduce": (False, "MPI's collective component chooses the algorithm"),
    "--no-hierarchical-allreduce": (False, "MPI's collective component chooses the algorithm"),
    "--hierarchical-allgather": (False, "MPI's collective component chooses the algorithm"),
    "--no-hierarchical-allgather": (False, "MPI's collective component chooses the algorithm"),
    "--autotune": (False, "MaTEx has no autotuner"),
    "--autotune-log-file": (True, "MaTEx has no autotuner"),
    "--timeline-mark-cycles": (False, "MaTEx has no background cycle"),
    "--no-stall-check": (False, "MaTEx's stall inspector is always on"),
    "--stall-check-warning-time-seconds": (True, "set MATEX_STALL_* variables instead"),
    "--stall-check-shutdown-time-seconds": (True, "set MATEX_STALL_* variables instead"),
    "--mpi-threads-disable": (False, "MaTEx needs MPI_THREAD_MULTIPLE"),
    "--num-nccl-streams": (True, "MaTEx does not use NCCL"),
    "--log-level": (True, "MaTEx logs through Python's logging"),
    "--binding-args": (True, "give mpiexec's binding with --mpi-arg"),
    "--ssh-port": (True, "give ssh options with --launch-agent"),
    "--ssh-identity-file": (True, "give ssh options with --launch-agent"),
    "--blacklist-cooldown-range": (2, "matexrun keeps no blacklist: it restarts on the hosts "
                                      "the discovery script lists"),
}


class _IgnoredFlag(argparse.Action):
    """Records a horovodrun flag that has no meaning here (named once, by the launcher)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.ignored_flags.append(option_string)


def _add_horovodrun_options(parser):
    group = parser.add_argument_group(
        "horovodrun's flags", "accepted so that horovodrun command lines run (docs/horovod.md)")
    group.add_argument("--horovod", action="store_true",
                       help="run a Horovod script unmodified: 'import horovod...' resolves to "
                            "matex.horovod in every rank")
    group.add_argument("--timeline-filename", metavar="FILE",
                       help="write one timeline of the whole job to FILE (each rank records "
                            "into FILE-ranks/, merged into FILE when the job ends)")
    group.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                       help="gradient fusion bucket size in MiB (MATEX_FUSION_THRESHOLD; 0 "
                            "sends each gradient alone)")
    group.add_argument("--network-interface", dest="tcp_if", metavar="IF[,...]",
                       help="as --tcp-if")
    group.add_argument("--start-timeout", type=float, metavar="SECONDS",
                       help="seconds every rank has to start (MATEX_START_TIMEOUT)")
    group.add_argument("--check-build", dest="check", action="store_true",
                       help="as --check")
    parser.set_defaults(ignored_flags=[])
    for flag, (takes_value, why) in HOROVODRUN_IGNORED.items():
        if flag == "--blacklist-cooldown-range":
            continue   # an elastic flag (_add_elastic_options)
        group.add_argument(flag, action=_IgnoredFlag, nargs=int(takes_value),
                           dest="ignored_flags", help=argparse.SUPPRESS)


def _add_elastic_options(parser):
    group = parser.add_argument_group(
        "elastic", "restart the job on the hosts available when it dies (a whole host lost "
        "with its MPI daemon, which ULFM cannot survive); docs/fault-tolerance.md")
    group.add_argument("--elastic", action="store_true",
                       help="implies --ft: when the job dies, restart it (up to --reset-limit "
                            "times) on the hosts --host-discovery-script lists then (else the "
                            "same hosts), from the last commit (hvd.elastic) or checkpoint "
                            "(fit) in --checkpoint-dir")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="horovodrun's: an executable printing the hosts available now, one "
                            "HOST or HOST:SLOTS per line; implies --elastic; gives the first "
                            "launch's hosts too")
    group.add_argument("--slots-per-host", "--slots", dest="slots", type=int, metavar="N",
                       help="slots of a host the discovery script lists without any (default 1)")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                       help="restart on no fewer than N ranks: wait up to --elastic-timeout "
                            "for the discovery script to list enough slots (default 1)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="restart on at most N ranks (default: the first launch's)")
    group.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long to wait for --min-np slots before giving up "
                            "(default %(default).0f)")
    group.add_argument("--reset-limit", type=int, default=3, metavar="N",
                       help="restart at most N times (default %(default)s)")
    group.add_argument("--blacklist-cooldown-range", action=_IgnoredFlag, nargs=2,
                       dest="ignored_flags", help=argparse.SUPPRESS)


def _plan_elastic(opts, parser):
    """Check ``--elastic``'s options; the first launch's hosts come from the discovery
    script when there is one. ``--elastic`` implies ``--ft``."""
    if opts.host_discovery_script:
        opts.elastic = True
    if not opts.elastic:
        for flag in ("min_np", "max_np", "slots"):
            if getattr(opts, flag) is not None:
                parser.error("--%s goes with --elastic or --host-discovery-script"
                             % flag.replace("_", "-"))
        return
    if opts.restart:
        parser.error("--elastic restarts by itself; do not combine it with --restart")
    opts.ft = True
    for flag in ("min_np", "max_np", "slots"):
        if getattr(opts, flag) is not None and getattr(opts, flag) < 1:
            parser.error("--%s must be at least 1" % flag.replace("_", "-"))
    if opts.reset_limit < 0:
        parser.error("--reset-limit must not be negative")
    if opts.elastic_timeout < 0:
        parser.error("--elastic-timeout must not be negative")
    if opts.min_np and opts.max_np and opts.min_np > opts.max_np:
        parser.error("--min-np %d is above --max-np %d" % (opts.min_np, opts.max_np))
    if not opts.host_discovery_script:
        return
    if opts.hosts or opts.hostfile:
        parser.error("give the hosts with --host-discovery-script or with -H/--hostfile, "
                     "not both")
    try:
        hosts = discover_hosts(opts.host_discovery_script, opts.slots)
    except HostError as exc:
        parser.error(str(exc))
    if not hosts:
        parser.error("the host discovery script %s lists no host" % opts.host_discovery_script)
    opts.hosts = [",".join("%s:%d" % host for host in hosts)]
    opts.slurm = False


def _elastic_replan(opts, mpiexec, env, program, rest_args, first_nranks):
    """``run_with_restarts``'s plan under ``--elastic``: the hosts the discovery script lists
    now (or the same command without one), at most ``--max-np`` ranks, at least ``--min-np``."""
    most = opts.max_np or first_nranks
    least = opts.min_np or 1

    def replan(cmd, nranks):
        if not opts.host_discovery_script:
            return cmd, nranks
        deadline, waiting = time.monotonic() + opts.elastic_timeout, False
        while True:
            try:
                hosts = discover_hosts(opts.host_discovery_script, opts.slots)
            except HostError as exc:
                print("matexrun: %s; not restarting" % exc, file=sys.stderr, flush=True)
                return None
            n = min(total_slots(hosts), most) if hosts else 0
            spec = ",".join("%s:%d" % host for host in hosts)
            if n >= least:
                break
            if time.monotonic() >= deadline:
                print("matexrun: the host discovery script lists %d slot(s) (%s), fewer than "
                      "--min-np %d%s; not restarting" % (
                          n, spec or "no host", least,
                          " after %.0f s (--elastic-timeout)" % opts.elastic_timeout
                          if waiting else ""), file=sys.stderr, flush=True)
                return None
            if not waiting:
                print("matexrun: the host discovery script lists %d slot(s), fewer than "
                      "--min-np %d; waiting up to %.0f s for more" % (n, least,
                                                                      opts.elastic_timeout),
                      file=sys.stderr, flush=True)
                waiting = True
            time.sleep(DISCOVERY_POLL_S)
        print("matexrun: hosts available now: %s" % spec, file=sys.stderr, flush=True)
        args = cluster_mpi_args(mpiexec, hosts=hosts, launch_agent=opts.launch_agent,
                                tcp_if=opts.tcp_if, env=env)
        return mpiexec_command(n, program, mpi_args=args + rest_args, mpiexec=mpiexec,
                               oversubscribe=False), n

    return replan


def _horovodrun_env(opts, parser) -> dict:
    """The ranks' variables for horovodrun's flags that map onto MaTEx settings."""
    env = {}
    if opts.fusion_threshold_mb is not None:
        if opts.fusion_threshold_mb < 0:
            parser.error("--fusion-threshold-mb must not be negative")
        env["MATEX_FUSION_THRESHOLD"] = str(int(opts.fusion_threshold_mb * 1024 * 1024))
    if opts.start_timeout is not None:
        if opts.start_timeout <= 0:
            parser.error("--start-timeout must be positive")
        env["MATEX_START_TIMEOUT"] = str(opts.start_timeout)
    return env


def build_parser() -> argparse.ArgumentParser:
    """``matexrun``'s argument parser (docs/reference/cli.md is generated from it)."""
    parser = argparse.ArgumentParser(
        prog="matexrun", description="Run a TensorFlow/Keras script on several MPI ranks.")
    parser.add_argument("-n", "--np", "-np", dest="nranks", type=int, default=None,
                        help="number of ranks (default 1, or the slots of the hosts given, "
                             "or SLURM_NTASKS in a Slurm allocation)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the mpiexec command before running it")
    parser.add_argument("--all-ranks", action="store_true",
                        help="show every rank's stdout, prefixed by its rank")
    parser.add_argument("--ft", action="store_true",
                        help="fault tolerance: survive rank failures (ULFM shrink-and-continue)."
                             " Exit status: 0 when the ranks that survive finish their script "
                             "cleanly (ranks lost on the way do not fail the job); 1 when no "
                             "rank finished (every rank failed or was killed); else the first "
                             "non-zero status of a surviving rank. A rank the survivors "
                             "excluded but that still runs (hung) is ended once they are done")
    parser.add_argument("--ft-heartbeat", type=float, default=DEFAULT_HEARTBEAT,
                        metavar="SECONDS",
                        help="failure detector heartbeat period with --ft (default %(default)s s)")
    parser.add_argument("--status-dir", metavar="DIR",
                        help="with --ft: where the ranks report failures (a temporary "
                             "directory is made in DIR and removed); default: the system's "
                             "temporary directory on one machine, the current directory "
                             "with other hosts (it must be shared with them)")
    parser.add_argument("--restart", type=int, default=0, metavar="N",
                        help="without --ft: after a failure, restart from the last checkpoint "
                             "up to N times, each time on one rank fewer")
    parser.add_argument("--checkpoint-dir", default="matex-checkpoint", metavar="DIR",
                        help="where --restart keeps its checkpoints (default ./matex-checkpoint)")
    parser.add_argument("--inject-fault", metavar="SPEC",
                        help='inject faults, e.g. "rank=2,step=30,kind=kill" (see matex._faults)')
    parser.add_argument("--ranks-per-trial", type=int, default=None, metavar="K",
                        help="hyperparameter search (Keras Tuner, matex.hpo): ranks that train "
                             "one trial together, data-parallel; must divide -n (default: all)")
    parser.add_argument("--timeline", metavar="DIR",
                        help="each rank writes a Chrome-trace timeline to DIR/timeline-rank<N>"
                             ".json (merge: python -m matex.timeline merge DIR)")
    parser.add_argument("--timeline-steps", metavar="FIRST-LAST",
                        help="with --timeline: record only these training steps, e.g. 100-120")
    parser.add_argument("--monitor", action="store_true",
                        help="rank 0 prints the job's samples/s, slowest rank and allreduce "
                             "share every MATEX_MONITOR_INTERVAL seconds (default 10)")
    parser.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpiexec (repeatable). With Open MPI, "
                             "matexrun runs ranks unbound on one machine (--bind-to none; "
                             "give --mpi-arg=--bind-to --mpi-arg=core to bind) and, with "
                             "Open MPI 5 and without --all-ranks, relays output as written "
                             "(--output :raw: live progress bars)")
    parser.add_argument("--check", action="store_true",
                        help="check the installation instead of running a script: TensorFlow, "
                             "Keras, the MPI library and its thread level, ULFM, the compiler, "
                             "the ops' build cache, mpiexec; exit status 1 and the fix when "
                             "something is wrong (builds nothing, starts no rank)")
    parser.add_argument("--build", action="store_true",
                        help="with --check: build the ops now if their cache is cold")
    _add_cluster_options(parser)
    _add_horovodrun_options(parser)
    _add_elastic_options(parser)
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                        help="run a module as python -m does, e.g. -m pytest -q test_x.py "
                             "(instead of a script; what follows are its arguments)")
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``matexrun``'s arguments, start mpiexec, return the job's exit status."""
    if "mpi4py.MPI" not in sys.modules:
        # The launcher only looks at the MPI library (to find its mpiexec):
        # initialising it would make this process an MPI singleton, slow to
        # start and, under --ft (no MPI_Finalize), leaving a segment behind.
        import mpi4py

        mpi4py.rc.initialize = False
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        # `pkill -USR1 -f train.py` reaches matexrun too: it is no rank, it neither
        # dumps (that would overwrite rank 0's dump) nor dies (orphaning mpiexec).
        # A handler, not SIG_IGN: an ignored signal stays ignored in the ranks.
        signal.signal(signal.SIGUSR1, _ignore_signal)
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.build and not opts.check:
        parser.error("--build goes with --check")
    if opts.check:
        if opts.script is not None or opts.module:
            parser.error("--check runs no script (got %s)" % (opts.script or opts.module[0]))
        from matex import _check

        return _check.main(build=opts.build)
    if opts.module is not None:
        if opts.script is not None:
            parser.error("give a script or -m MODULE, not both")
        if not opts.module:
            parser.error("-m needs a module name")
        target = ["-m"] + opts.module
    elif opts.script is None:
        parser.error("the following arguments are required: script (or -m MODULE, or --check)")
    else:
        target = [opts.script] + opts.args
    if opts.nranks is not None and opts.nranks < 1:
        parser.error("-n must be at least 1")
    if opts.script is not None and not os.path.isfile(opts.script):
        parser.error("no such script: %s" % opts.script)
    for flag in dict.fromkeys(opts.ignored_flags):   # once each, from the launcher only
        print("matexrun: horovodrun's %s has no meaning with MaTEx (%s); ignored"
              % (flag, HOROVODRUN_IGNORED[flag][1]), file=sys.stderr)
    if opts.timeline_filename:
        if opts.timeline:
            parser.error("give --timeline DIR or --timeline-filename FILE, not both")
        opts.timeline = opts.timeline_filename + "-ranks"
    _plan_elastic(opts, parser)
    given_nranks = opts.nranks
    env = launch_env()
    mpiexec = find_mpiexec()
    nranks, cluster_args, hostfile_text, notes = _plan_cluster(opts, parser, env, mpiexec)
    cluster_env = dict(env)   # what the cluster arguments forward (-x): again on a restart
    if opts.elastic and given_nranks is None and opts.max_np and nranks > opts.max_np:
        nranks = opts.nranks = opts.max_np
    if opts.elastic and opts.min_np and nranks < opts.min_np:
        parser.error("--min-np %d is above the %d rank(s) of the first launch"
                     % (opts.min_np, nranks))
    mpi_args = list(opts.mpi_arg)
    status_parent = None
    if opts.ft:
        if opts.ft_heartbeat <= 0:
            parser.error("--ft-heartbeat must be positive")
        status_parent = _status_parent(opts, parser, cluster_args)
        mpi_args = ft_mpi_args(opts.ft_heartbeat) + ["-x", STATUS_DIR_VAR] + mpi_args
    elif opts.status_dir:
        parser.error("--status-dir goes with --ft")
    if opts.inject_fault:
        from matex import _faults

        _faults.parse(opts.inject_fault)   # reject a bad spec before launching
        env["MATEX_INJECT_FAULT"] = opts.inject_fault
        if "MATEX_INJECT_FAULT" not in cluster_args:
            mpi_args = ["-x", "MATEX_INJECT_FAULT"] + mpi_args
    if opts.ranks_per_trial is not None:
        if opts.ranks_per_trial < 1:
            parser.error("--ranks-per-trial must be at least 1")
        if nranks % opts.ranks_per_trial:
            parser.error("--ranks-per-trial %d does not divide the number of ranks (%d)"
                         % (opts.ranks_per_trial, nranks))
        env["MATEX_RANKS_PER_TRIAL"] = str(opts.ranks_per_trial)
        if "MATEX_RANKS_PER_TRIAL" not in cluster_args:
            mpi_args = ["-x", "MATEX_RANKS_PER_TRIAL"] + mpi_args
    for var, value in {**_observability_env(opts, parser),
                       **_horovodrun_env(opts, parser)}.items():
        env[var] = value
        if var not in cluster_args:
            mpi_args = ["-x", var] + mpi_args
    if opts.restart and opts.ft:
        parser.error("--restart is the fallback without ULFM; do not combine it with --ft")
    if opts.restart or opts.elastic:
        env["MATEX_CHECKPOINT_DIR"] = os.path.abspath(opts.checkpoint_dir)
        if "MATEX_CHECKPOINT_DIR" not in cluster_args:
            mpi_args = ["-x", "MATEX_CHECKPOINT_DIR"] + mpi_args
    rest_args = _output_and_binding_args(mpiexec, opts, cluster_args, opts.mpi_arg) + mpi_args
    mpi_args = cluster_args + rest_args
    runner = [sys.executable, "-m", "matex"] + (["--all-ranks"] if opts.all_ranks else []) + (
        ["--horovod"] if opts.horovod else [])
    tmpdir = None
    try:
        if hostfile_text is not None:
            tmpdir = tempfile.mkdtemp(prefix="matexrun-")
            path = os.path.join(tmpdir, "hostfile")
            with open(path, "w") as out:
                out.write(hostfile_text)
            mpi_args = [path if a == "{hostfile}" else a for a in mpi_args]
        cmd = mpiexec_command(nranks, runner + target, mpi_args=mpi_args,
                              mpiexec=mpiexec, oversubscribe=False if cluster_args else None)
        for note in notes:
            if opts.verbose or opts.dry_run or note.startswith("warning:"):
                print("matexrun: " + note, file=sys.stderr)
        if opts.verbose or opts.dry_run:
            if hostfile_text is not None:
                print("matexrun: hostfile %s:" % path, file=sys.stderr)
                for line in hostfile_text.splitlines():
                    print("matexrun:   " + line, file=sys.stderr)
            print("matexrun: " + " ".join(cmd), file=sys.stderr, flush=True)
        if opts.dry_run:
            return 0
        if opts.elastic:
            def launch(cmd, env, nranks):
                return run_fault_tolerant(cmd, env, nranks, status_parent,
                                          one_host=not cluster_args)

            code = run_with_restarts(cmd, nranks, env, opts.reset_limit, run=launch,
                                     replan=_elastic_replan(opts, mpiexec, cluster_env,
                                                            runner + target, rest_args, nranks))
        elif opts.ft:
            code = run_fault_tolerant(cmd, env, nranks, status_parent,
                                      one_host=not cluster_args)
        else:
            code = run_with_restarts(cmd, nranks, env, opts.restart)
        if opts.timeline_filename:
            _merge_timeline(opts.timeline, opts.timeline_filename)
        return code
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _merge_timeline(directory, filename):
    """``--timeline-filename``: the ranks' timelines merged into one file, as horovodrun writes."""
    from matex.timeline import _merge

    try:
        _merge.merge(directory, filename)
    except (OSError, ValueError) as exc:
        print("matexrun: could not merge the timelines of %s into %s: %s"
              % (directory, filename, exc), file=sys.stderr)
        return
    print("matexrun: timeline written to %s (per rank: %s)" % (filename, directory),
          file=sys.stderr)


def _output_and_binding_args(mpiexec, opts, cluster_args, user_args) -> list:
    """Open MPI 5 arguments for live output and unbound ranks (unless the user chose).

    * ``--output :raw``: mpiexec forwards output as it arrives instead of
      holding each rank's text until a newline, so Keras's progress bar
      (carriage-return updates) moves while an epoch runs. Not with
      ``--all-ranks``: there, whole lines keep several ranks' output apart.
    * ``--bind-to none`` on one machine: Open MPI binds rank r to core r when
      there are at most as many ranks as cores; next to busy processes, two
      bound ranks were reported to train half as fast as unbound ones (1.5
      against 3.0 epochs in 150 s with two busy background processes, #24). Bind explicitly with
      ``--mpi-arg=--bind-to --mpi-arg=core`` on a node of your own; Slurm
      allocations with several CPUs per task keep their own binding.
    """
    flavor, major = mpi_flavor(mpiexec)
    if flavor != "openmpi":
        return []
    args = []
    if (major or 0) >= 5 and not opts.all_ranks and "--output" not in user_args:
        args += ["--output", ":raw"]
    if not cluster_args and not any(a in ("--bind-to", "-bind-to") or a.startswith("--bind-to=")
                                    for a in user_args):
        args += ["--bind-to", "none"]
    return args


def _observability_env(opts, parser) -> dict:
    """``--timeline``/``--timeline-steps``/``--monitor`` as the ranks' variables, checked now:
    an unwritable timeline directory or a malformed step range fails before launching."""
    from matex import _config
    from matex.timeline import TimelineError, check_writable

    env = {}
    if opts.timeline_steps is not None:
        if not opts.timeline:
            parser.error("--timeline-steps goes with --timeline")
        try:
            _config.parse_step_range(opts.timeline_steps, "--timeline-steps")
        except ValueError as exc:
            parser.error(str(exc))
        env["MATEX_TIMELINE_STEPS"] = opts.timeline_steps
    if opts.timeline:
        try:
            check_writable(opts.timeline)
        except TimelineError as exc:
            parser.error(str(exc))
        env["MATEX_TIMELINE"] = os.path.abspath(opts.timeline)
    if opts.monitor:
        env["MATEX_MONITOR"] = "1"
    return env
