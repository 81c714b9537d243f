"""Flight recorder, stall inspector and ``python -m matex.flight`` under real mpiexec.

The probe (tests/scripts/flight_probe.py) runs allreduces on the NumPy core
(no TensorFlow, so each job takes seconds) on 3 ranks and goes wrong on
purpose: a mismatch, a rank that sleeps before a collective, a rank that
skips one, SIGUSR1. The kill test trains tests/scripts/ft_fit.py under
``--with-ft ulfm`` with rank 2 killed in step 5.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import mpitools
from matex import flight
from matex import launcher as launch

PROBE = str(mpitools.ROOT / "tests" / "scripts" / "flight_probe.py")
FT_SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "ft_fit.py")


def _probe(tmp_path, mode, **env):
    full = dict(os.environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"),
                **{k: str(v) for k, v in env.items()})
    mpi_args = ["-x", "MATEX_FLIGHT_DIR"] + sum((["-x", k] for k in env), [])
    return mpitools.run_mpi(3, [sys.executable, PROBE, mode], mpi_args=mpi_args, timeout=120,
                            env=full, cwd=tmp_path)


def _stall_lines(err):
    return [line for line in err.splitlines() if line.startswith("matex: stall:")]


def _cli(directory):
    return subprocess.run([sys.executable, "-m", "matex.flight", str(directory)],
                          capture_output=True, text=True, timeout=60)


def test_mismatch_dumped_and_analysed(tmp_path):
    proc = _probe(tmp_path, "mismatch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumps = flight.load(tmp_path / "flight")
    assert [d["world_rank"] for d in dumps] == [0, 1, 2]
    for d in dumps:
        assert d["reason"] == "exit after a failed collective"
        assert [e["seq"] for e in d["entries"]] == [1, 2, 3, 4, 5]
        assert [e["comm_seq"] for e in d["entries"]] == [1, 2, 3, 4, 5]
        assert len({e["comm"] for e in d["entries"]}) == 1
        assert [e["state"] for e in d["entries"]] == ["ok"] * 4 + ["mismatch"]
        last = d["entries"][-1]
        assert last["comm_size"] == 3 and last["dtype"] == "float32"
        assert last["shape"] == ([5] if d["world_rank"] == 2 else [4])
        assert last["site"].endswith("flight_probe.py:29"), last["site"]
        assert all(e["start"] <= e["agreed"] <= e["end"] for e in d["entries"])
    finding = flight.analyse(dumps)
    assert (finding.kind, finding.ranks, finding.seq) == ("divergence", [2], 5)
    cli = _cli(tmp_path / "flight")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("ranks diverge at collective #5 on the communicator of all 3 "
                                 "ranks: rank 2 ran #5 allreduce(sum) of float32[5]"), cli.stdout
    assert "First divergent: rank 2." in cli.stdout


def test_stall_names_the_sleeping_rank(tmp_path):
    # Ranks 0 and 1 ran 2 collectives on a sub-communicator first: their process-wide
    # counts (6 and 5) differ from rank 2's (4); only the world communicator's own count
    # says who has not arrived (before: rank 2 saw rank 1 at #5 >= #4, "none", and rank 0
    # named rank 2, which was waiting in it).
    proc = _probe(tmp_path, "sleep", MATEX_STALL_WARNING_S=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _stall_lines(proc.stderr)
    # one line per waiting rank (0 and 2), none from the sleeping rank 1
    assert sorted(line.split()[3] for line in lines) == ["0", "2"], proc.stderr[-3000:]
    for line in lines:
        assert "in collective #4 allreduce(sum) of float32[4]" in line, line
        assert "on the communicator of all 3 ranks; ranks not arrived:" in line, line
        assert "ranks not arrived: rank 1 [last collective #3; now at " in line, line
        assert "flight_probe.py:46 in main: time.sleep(5)" in line, line
        assert "rank 0 [" not in line and "rank 2 [" not in line, line


def test_stall_names_the_skipping_rank_and_aborts(tmp_path):
    proc = _probe(tmp_path, "skip", MATEX_STALL_WARNING_S=2, MATEX_STALL_ABORT_S=4)
    assert proc.returncode != 0, "the stall abort must end the job"
    lines = _stall_lines(proc.stderr)
    assert {line.split()[3] for line in lines} <= {"0", "2"} and lines, proc.stderr[-3000:]
    for line in lines:
        assert "ranks not arrived: rank 1 [last collective #3; now at " in line, line
        assert "flight_probe.py:53 in main: time.sleep(30)" in line, line
    assert "(MATEX_STALL_ABORT_S=4)" in proc.stderr
    dumps = flight.load(tmp_path / "flight")
    assert [d["world_rank"] for d in dumps] == [0, 1, 2]   # the late rank answered too
    finding = flight.analyse(dumps)
    assert (finding.kind, finding.ranks, finding.seq) == ("stopped", [1], 4)
    assert _cli(tmp_path / "flight").stdout.startswith(
        "rank 1 stopped first: it reached collective #3 on the communicator of all 3 ranks, "
        "while ranks 0, 2 reached #4 ")


def test_sigusr1_dumps_every_rank(tmp_path):
    # before the dumps, ranks 0 and 1 ran 5 allreduces of float32[2] on a sub-communicator,
    # then all ran a 4th on the world: the entries pair by (communicator, number on it)
    proc = _probe(tmp_path, "usr1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("dumped True") == 3, proc.stdout
    dumps = []
    for rank in range(3):
        d = json.loads((tmp_path / "flight" / ("rank%d.json" % rank)).read_text())
        dumps.append(d)
        assert d["reason"] == "SIGUSR1" and d["pending_since"] == 0
        assert d["sequence"] == (9 if rank < 2 else 4)   # this process's, all communicators
        assert d["world_rank"] == rank and d["world_size"] == 3
        ops = ["allreduce(sum) of float32[4]"] * 3 + (
            ["allreduce(sum) of float32[2]"] * 5 if rank < 2 else []) + [
            "allreduce(sum) of float32[4]"]
        assert [e["op"] for e in d["entries"]] == ops
        main = next(iter(d["stacks"].values()))
        assert "flight_probe.py" in main["where"] and main["stack"]
    world = {e["comm"] for d in dumps for e in d["entries"] if e["shape"] == [4]}
    sub = {e["comm"] for d in dumps for e in d["entries"] if e["shape"] == [2]}
    assert len(world) == 1 and len(sub) == 1 and world != sub, (world, sub)
    for d in dumps:
        assert [e["comm_seq"] for e in d["entries"] if e["comm"] in world] == [1, 2, 3, 4]
        assert [e["comm_seq"] for e in d["entries"] if e["comm"] in sub] == (
            [1, 2, 3, 4, 5] if d["world_rank"] < 2 else [])
        comms = {c["comm"]: c for c in d["comms"]}
        assert comms[next(iter(world))]["members"] == [0, 1, 2]
        assert comms[next(iter(world))]["seq"] == 4
        mine = [c for c in d["comms"] if c["comm"] not in world]
        assert [(c["members"], c["seq"]) for c in mine] == (
            [([0, 1], 5)] if d["world_rank"] < 2 else [([2], 0)])
    finding = flight.analyse(flight.load(tmp_path / "flight"))
    assert (finding.kind, finding.ranks) == ("consistent", []), finding.report
    assert finding.report.startswith(
        "no divergence: every member of each communicator reached the same collective "
        "(the communicator of all 3 ranks: #4; the communicator of ranks 0, 1: #5; "
        "the communicator of rank 2: #0)"), finding.report


def _entry(comm, n, seq, shape, state="ok", start=0.0):
    return {"seq": seq, "comm": comm, "comm_seq": n, "op": "allreduce(sum) of float32%s" % shape,
            "signature": hash(tuple(shape)), "state": state, "start": start or float(seq),
            "site": "", "shape": shape}


def _dump(rank, entries, comms):
    return {"world_rank": rank, "world_size": 3, "host": "h", "reason": "stall",
            "sequence": len(entries), "entries": entries, "comms": comms, "stacks": {}}


def test_analysis_compares_counts_within_each_communicator():
    # ranks 0 and 1 ran 4 collectives on their sub-communicator S after 4 on the world W;
    # rank 0 waits in S's #5, which rank 1 never started. Process-wide counts (9, 8, 4) would
    # blame rank 2, which is not even a member of S.
    world = [_entry("W", n, n, [4]) for n in range(1, 5)]
    sub = [_entry("S", n, 4 + n, [2]) for n in range(1, 5)]
    w = {"comm": "W", "members": [0, 1, 2], "seq": 4, "pending_seq": 0, "pending_since": 0,
         "current": True}

    def s(seq, pending):
        return {"comm": "S", "members": [0, 1], "seq": seq, "pending_seq": seq if pending else 0,
                "pending_since": 100.0 if pending else 0, "current": True}

    dumps = [_dump(0, world + sub + [_entry("S", 5, 9, [2], "pending")], [w, s(5, True)]),
             _dump(1, world + sub, [w, s(4, False)]),
             _dump(2, world, [w, {"comm": "T", "members": [2], "seq": 0, "pending_seq": 0,
                                  "pending_since": 0, "current": True}])]
    finding = flight.analyse(dumps)
    assert (finding.kind, finding.ranks, finding.seq, finding.comm) == ("stopped", [1], 5, "S")
    assert finding.report.startswith(
        "rank 1 stopped first: it reached collective #4 on the communicator of ranks 0, 1, "
        "while rank 0 reached #5 allreduce(sum) of float32[2]"), finding.report
    # the same collective numbers on different communicators never pair: a real divergence
    # on S is found, at S's #3, not at process-wide #7
    dumps[1]["entries"][6] = _entry("S", 3, 7, [3])
    finding = flight.analyse(dumps)
    assert (finding.kind, finding.ranks, finding.seq, finding.comm) == (
        "divergence", [0, 1], 3, "S"), finding.report


def test_bad_dump_directories(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cli = _cli(empty)
    assert cli.returncode == 2 and "holds no flight dumps" in cli.stderr, cli.stderr
    cli = _cli(tmp_path / "nowhere")
    assert cli.returncode == 2 and "is not a directory" in cli.stderr, cli.stderr
    (empty / "rank0.json").write_text("{not json")
    with pytest.raises(flight.FlightError, match="rank0.json is not a readable flight dump"):
        flight.load(empty)


def test_bad_settings(monkeypatch):
    from matex import _config

    monkeypatch.setenv("MATEX_STALL_WARNING_S", "soon")
    with pytest.raises(ValueError, match="MATEX_STALL_WARNING_S must be a number"):
        _config.stall_warning_s()
    monkeypatch.setenv("MATEX_FLIGHT_ENTRIES", "-1")
    with pytest.raises(ValueError, match="MATEX_FLIGHT_ENTRIES must be >= 0"):
        _config.flight_entries()


@pytest.mark.ulfm
def test_kill_under_ft_dumps_survivors_and_names_the_dead_rank(tmp_path):
    env = launch.launch_env()
    env.update(TF_CPP_MIN_LOG_LEVEL="2", MATEX_FLIGHT_DIR=str(tmp_path / "flight"),
               MATEX_INJECT_FAULT="rank=2,step=5,kind=kill")
    mpi_args = ["-x", "MATEX_INJECT_FAULT", "-x", "MATEX_FLIGHT_DIR"] + launch.ft_mpi_args()
    cmd = launch.mpiexec_command(3, [sys.executable, "-m", "matex", FT_SCRIPT,
                                     str(tmp_path / "r"), "300", "32", "1"], mpi_args=mpi_args)
    proc = launch.run_captured(cmd, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dumps = flight.load(tmp_path / "flight")
    assert [d["world_rank"] for d in dumps] == [0, 1], proc.stderr[-3000:]
    assert all(d["reason"] == "rank failure" for d in dumps)
    failed = [[e for e in d["entries"] if e["state"] == "MPI error"] for d in dumps]
    assert all(len(f) == 1 for f in failed), failed
    seq = failed[0][0]["comm_seq"]
    assert (failed[1][0]["comm"], failed[1][0]["comm_seq"]) == (failed[0][0]["comm"], seq)
    assert failed[0][0]["comm_size"] == 3
    assert failed[0][0]["op"].startswith(("allreduce", "fused allreduce")), failed[0][0]
    finding = flight.analyse(dumps)
    assert (finding.kind, finding.ranks, finding.seq) == ("stopped", [2], seq)
    out = _cli(tmp_path / "flight").stdout
    assert out.startswith("rank 2 stopped first (left no dump: died or was killed): ranks 0, 1 "
                          "failed in collective #%d " % seq), out


EARLY_USR1 = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import numpy as np
    import matex
    from pathlib import Path
    dump = Path(sys.argv[1]) / "rank0.json"

    def usr1_and_wait(previous):
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 30
        while time.time() < deadline:
            time.sleep(0.05)
            if dump.exists() and json.loads(dump.read_text())["time"] != previous:
                return json.loads(dump.read_text())
        raise SystemExit("no dump")

    early = usr1_and_wait(None)   # before the core is loaded: was the default action (death)
    print("early", early["reason"], len(early["entries"]), flush=True)
    # the first collective on another thread (as in fit): the core's handler takes over
    worker = threading.Thread(target=lambda: matex.allreduce(np.ones(3, "float32"), "sum"))
    worker.start()
    worker.join()
    late = usr1_and_wait(early["time"])
    print("late", late["reason"], [e["op"] for e in late["entries"]], flush=True)
""")


def test_sigusr1_before_the_core_loads_dumps_instead_of_killing(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(EARLY_USR1)
    env = dict(os.environ, MATEX_FLIGHT_DIR=str(tmp_path / "flight"), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "flight")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.splitlines() == [
        "early SIGUSR1 0", "late SIGUSR1 ['allreduce(sum) of float32[3]']"], proc.stdout
