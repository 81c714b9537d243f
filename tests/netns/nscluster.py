"""A "cluster" of network namespaces on this machine, for multi-host MPI tests.

Each host is a network namespace with its own address on a private bridge
(in a switch namespace, so nothing touches the machine's own network) and,
for every process started in it, its own hostname. ``mpiexec`` runs inside
host 0 and reaches the others through ``agent.sh``, which stands in for ssh.

    with Cluster(2) as cluster:
        proc = cluster.matexrun(["--hostfile", cluster.hostfile(2), "script.py"])

Needs root, iproute2 (``ip netns``) and util-linux (``unshare``). ``ensure_tools``
installs iproute2 with apt-get when it is missing; ``available`` says why the
cluster cannot be made here (then tests skip).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER_SH = HERE / "cluster.sh"
AGENT_SH = HERE / "agent.sh"
SUBNET = "198.18.77"          # RFC 2544 benchmarking range, only inside the namespaces
NAME_RE = re.compile(r"^mtx(\d+)n\d+-")
_count = 0


def ensure_tools():
    """Install iproute2 (ip) with apt-get if missing; return the reason when impossible."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                        "iproute2"], env=env, capture_output=True, timeout=300)
    for tool in ("ip", "unshare"):
        if not shutil.which(tool):
            return "%s not found (apt-get install iproute2 util-linux)" % tool
    return None


def available():
    """None when namespaces can be made here, else the reason."""
    reason = ensure_tools()
    if reason:
        return reason
    probe = "mtx%dn0-probe" % os.getpid()
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return "cannot create a network namespace: %s" % made.stderr.strip()
    return None


def remove_stale():
    """Delete namespaces left by earlier test processes that are gone (killed runs)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    prefixes = set()
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        found = NAME_RE.match(name)
        if found and not Path("/proc", found.group(1)).exists():
            prefixes.add(name.rsplit("-", 1)[0])
    for prefix in prefixes:
        subprocess.run(["sh", str(CLUSTER_SH), "down", prefix], capture_output=True)


class Cluster:
    """``nhosts`` namespace hosts named PREFIX-h0 ...; mpiexec runs on PREFIX-h0."""

    def __init__(self, nhosts):
        global _count
        _count += 1
        self.nhosts = nhosts
        self.prefix = "mtx%dn%d" % (os.getpid(), _count)
        self.hosts = ["%s-h%d" % (self.prefix, i) for i in range(nhosts)]
        self.addresses = ["%s.%d" % (SUBNET, i + 1) for i in range(nhosts)]
        self.workdir = Path(os.environ.get("TMPDIR", "/tmp")) / self.prefix
        self.agent_log = self.workdir / "agent.log"

    # -- lifetime
    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self):
        remove_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["sh", str(CLUSTER_SH), "up", self.prefix, str(self.nhosts)],
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, MATEX_NETNS_SUBNET=SUBNET))
        if proc.returncode != 0:
            self.down()
            raise RuntimeError("cluster.sh up failed: %s" % proc.stderr)

    def down(self):
        subprocess.run(["sh", str(CLUSTER_SH), "down", self.prefix], capture_output=True,
                       timeout=60)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- helpers
    def hostfile(self, slots, name="hostfile"):
        """Write a hostfile (``slots``: an int for every host, or a list); return its path."""
        slots = slots if isinstance(slots, (list, tuple)) else [slots] * self.nhosts
        path = self.workdir / name
        path.write_text("".join("%s slots=%d\n" % (h, s) for h, s in zip(self.hosts, slots)
                                if s))
        return str(path)

    def pids(self, host):
        """Pids of the processes running in ``host``'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def processes(self, host):
        """``[(pid, command line)]`` of the processes in ``host``'s namespace."""
        procs = []
        for pid in self.pids(host):
            try:
                cmd = Path("/proc/%d/cmdline" % pid).read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            procs.append((pid, cmd.decode(errors="replace").strip()))
        return procs

    def kill_all(self):
        for host in self.hosts:
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def diagnostics(self):
        """Text saying what runs where and what the agent launched."""
        lines = ["cluster %s: hosts %s" % (self.prefix, ", ".join(
            "%s=%s" % ha for ha in zip(self.hosts, self.addresses)))]
        for host in self.hosts:
            for pid, cmd in self.processes(host):
                lines.append("  %s pid %d: %s" % (host, pid, cmd[:200]))
        if self.agent_log.exists():
            lines.append("agent log:\n" + self.agent_log.read_text()[-3000:])
        return "\n".join(lines)

    def env(self, extra=None):
        env = dict(os.environ)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   TF_CPP_MIN_LOG_LEVEL="2", MATEX_NETNS_AGENT_LOG=str(self.agent_log),
                   PYTHONUNBUFFERED="1")
        env.update(extra or {})
        return env

    def start(self, argv, host=0, env=None):
        """Start ``argv`` on host ``host`` (a Popen in its own process group)."""
        return subprocess.Popen(["sh", str(CLUSTER_SH), "run", self.prefix, str(host)] + argv,
                                env=self.env(env), cwd=str(self.workdir),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def finish(self, proc, timeout):
        """Wait for ``proc``; on timeout kill it and everything in the cluster, then raise."""
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            diag = self.diagnostics()
            out, err = self.abort(proc)
            raise AssertionError("timed out after %ss: %s\n--- stdout\n%s\n--- stderr\n%s\n%s"
                                 % (timeout, " ".join(proc.args), out[-3000:], err[-5000:],
                                    diag))
        self._reap()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def abort(self, proc):
        """Kill ``proc``'s process group and everything in the cluster; its (stdout, stderr)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.kill_all()
        return proc.communicate()

    def _reap(self):
        """After a run, nothing of it may linger in the hosts (orphaned daemons)."""
        deadline = time.time() + 5
        while time.time() < deadline and any(self.pids(h) for h in self.hosts):
            time.sleep(0.1)
        self.kill_all()

    def run(self, argv, timeout=300, env=None, host=0):
        return self.finish(self.start(argv, host=host, env=env), timeout)

    def matexrun(self, args, timeout=300, env=None, tcp=True):
        """Run ``matexrun ARGS`` on host 0 with the agent (and TCP pinned to eth0)."""
        matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
        argv = [matexrun, "-v", "--launch-agent", str(AGENT_SH)]
        if tcp:
            argv += ["--tcp-if", "eth0", "--mpi-arg=--mca", "--mpi-arg=btl",
                     "--mpi-arg=tcp,self"]
        return self.run(argv + list(args), timeout=timeout, env=env)


LAUNCH_FAILURE = re.compile(r"daemon failed to report back|ORTE was unable to reliably start|"
                            r"PRTE has lost communication|unable to reach|failed to start",
                            re.I)


def launch_failed(proc):
    """Whether a run failed while starting remote daemons (worth one retry)."""
    return proc.returncode != 0 and bool(LAUNCH_FAILURE.search(proc.stderr or ""))
