"""Hosts beyond this machine: ``-H`` lists, hostfiles, Slurm allocations.

Everything here is pure text work (no ``scontrol`` unless a Slurm hostlist is
beyond ``expand_hostlist``), so a launch plan can be checked without a
cluster; ``cluster_mpi_args`` turns hosts into the MPI's own mpiexec syntax.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from matex.launcher.mpiexec import mpi_flavor

Hosts = list[tuple[str, int | None]]   # (name, slots or None)


class HostError(ValueError):
    """A host list, hostfile or Slurm allocation that cannot be understood."""


def parse_hosts(spec: str) -> Hosts:
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


def read_hostfile(path: str | os.PathLike) -> Hosts:
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


def expand_hostlist(text: str) -> list[str]:
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


def expand_counts(text: str) -> list[int]:
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

    def __init__(self, job_id: str, hosts: list[tuple[str, int]], ntasks: int,
                 cpus_per_task: int) -> None:
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


def slurm_allocation(env: Mapping[str, str] | None = None) -> SlurmAllocation | None:
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


def format_hostfile(hosts: Hosts, flavor: str = "openmpi") -> str:
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


def total_slots(hosts: Hosts) -> int:
    """Sum of slots, counting a host without slots as one."""
    return sum(1 if s is None else s for _, s in hosts)


# variables the ranks on other hosts need from the launching shell (Open MPI
# forwards only its own OMPI_*/PMIX_* ones by itself; Hydra forwards everything)
FORWARDED_PREFIXES = ("MATEX_", "TF_", "KERAS_", "PYTHONPATH", "PYTHONUNBUFFERED",
                      "PYTHONHASHSEED", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def forwarded_env(env: Mapping[str, str]) -> list[str]:
    """Names of the variables of ``env`` that ``-x`` forwards to the other hosts."""
    return sorted(k for k in env if k.startswith(FORWARDED_PREFIXES))


def cluster_mpi_args(mpiexec: str, hosts: Hosts | None = None, hostfile: str | None = None,
                     launch_agent: str | None = None, tcp_if: str | None = None,
                     cpus_per_task: int = 1, env: Mapping[str, str] | None = None,
                     flavor: tuple[str, int | None] | None = None) -> list[str]:
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
