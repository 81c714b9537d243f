"""Timeline (``matexrun --timeline``, ``matex.timeline``) and live monitor under real mpiexec.

tests/scripts/timeline_fit.py trains a tiny model with ``fit`` (20 steps per
epoch, 2 epochs; one fused gradient bucket per step). The runs go through
``matexrun`` itself, so its flags and their checks are tested too.
"""

import json
import os
import subprocess
import sys

import pytest

import mpitools
from matex import _config
from matex.timeline import TimelineError
from matex.timeline import _merge

SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "timeline_fit.py")
STEPS = 20   # per epoch; 2 epochs


def _matexrun(tmp_path, *flags, nranks=2, script_args=(), env=None, timeout=300):
    from matex import launcher

    full = launcher.launch_env(dict(os.environ, **(env or {})))
    full.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, "-m", "matex.launcher", "-n", str(nranks), *flags, SCRIPT,
           str(tmp_path / "out"), str(STEPS), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full,
                          cwd=tmp_path)


def _events(path):
    with open(path) as f:
        events = json.load(f)   # a clean stop leaves a complete JSON array
    assert isinstance(events, list) and events
    for e in events:
        assert {"ph", "pid", "tid"} <= set(e), e
        assert e["ph"] == "M" or isinstance(e["ts"], (int, float)), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    return events


def _spans(events, cat):
    return [e for e in events if e["ph"] == "X" and e.get("cat") == cat]


def _check_traces(directory, nranks):
    """Per-rank files and the merged one: valid, monotonic per rank, aligned across ranks."""
    for r in range(nranks):
        events = _events(directory / ("timeline-rank%d.json" % r))
        assert {e["pid"] for e in events} == {r}
        # every rank runs on this machine, on rank 0's clock: no offset to estimate (an
        # estimate is off by up to half a round trip: ms under load, which shifted a rank's
        # whole row and failed the checks below intermittently)
        meta = next(e["args"] for e in events if e.get("name") == "matex_timeline")
        assert (meta["clock_offset_s"], meta["round_trip_s"]) == (0.0, 0.0), meta
    merge = subprocess.run([sys.executable, "-m", "matex.timeline", "merge", str(directory)],
                           capture_output=True, text=True, timeout=60)
    assert merge.returncode == 0, merge.stderr
    merged = _events(directory / "merged.json")
    rows = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert rows == {r: "rank %d" % r for r in range(nranks)}
    by_rank = {r: sorted(_spans([e for e in merged if e["pid"] == r], "collective"),
                         key=lambda e: e["args"]["seq"]) for r in range(nranks)}
    assert all(by_rank.values()), by_rank
    for r, spans in by_rank.items():   # one rank's collectives run one after another
        for a, b in zip(spans, spans[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (r, a, b)
    # a collective is the same one on its communicator's members when its number on that
    # communicator is (each communicator has its own order; the process-wide seq is not)
    same = {}   # (comm, comm_seq) -> rank -> span
    for r, spans in by_rank.items():
        for e in spans:
            same.setdefault((e["args"]["comm"], e["args"]["comm_seq"]), {})[r] = e
    comms = {}   # comm -> (its ranks, its number of collectives)
    for (comm, n), spans in same.items():
        ranks, count = comms.get(comm, (set(spans), 0))
        assert set(spans) == ranks, (comm, n, sorted(spans), ranks)   # always the same members
        comms[comm] = (ranks, max(count, n))
    gaps = []
    for spans in same.values():
        starts = [e["ts"] for e in spans.values()]
        finish = [e["ts"] + e["dur"] for e in spans.values()]
        # nobody leaves a collective before the last rank entered it (1 ms of clock error).
        # How far apart ranks leave it is not checked: with the clocks exact (above), that is
        # only when each rank got a CPU back after MPI completed: whole scheduler ticks on
        # busy cores (4001, 8002 us measured on 2 oversubscribed cores, 0 when idle)
        gaps.append(max(starts) - min(finish))
    assert max(gaps) < 1000, "a rank left before another arrived: %.0f us" % max(gaps)
    waits = _spans(merged, "wait")
    checks = _spans(merged, "check")
    transfers = _spans(merged, "transfer")
    assert len(waits) == len(checks) == len(transfers) == sum(len(s) for s in same.values())
    key = {(e["pid"], e["args"]["seq"]): (e["args"]["comm"], e["args"]["comm_seq"])
           for spans in by_rank.values() for e in spans}
    for w in waits:   # the slowest rank is the latest to start that same collective
        spans = same[key[(w["pid"], w["args"]["seq"])]]
        assert w["args"]["slowest_rank"] == max(spans, key=lambda r: spans[r]["ts"]), w
    return merged, sorted((sorted(ranks), n) for ranks, n in comms.values())


def test_timeline_and_monitor_through_matexrun(tmp_path):
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * STEPS, 8)).astype("float32")
    with h5py.File(tmp_path / "rows.h5", "w") as f:   # read by matex.readers in the run
        f["x"] = x
        f["y"] = (x[:, :4].sum(1) > 0).astype("int64")
    proc = _matexrun(tmp_path, "--timeline", "tl", "--monitor",
                     env={"MATEX_MONITOR_INTERVAL": "0.2", "TEST_H5": str(tmp_path / "rows.h5")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    merged, comms = _check_traces(tmp_path / "tl", 2)
    assert [c[0] for c in comms] == [[0, 1]], comms   # one communicator: the world
    rank0 = [e for e in merged if e["pid"] == 0]
    steps = _spans(rank0, "step")
    assert sorted(e["args"]["step"] for e in steps) == list(range(2 * STEPS))
    phases = _spans(rank0, "phase")
    assert [p["name"] for p in phases[:3]] == ["forward+backward", "allreduce", "apply"]
    for step in steps:   # phases tile their step
        mine = [p for p in phases if p["args"]["step"] == step["args"]["step"]]
        assert len(mine) == 3
        assert abs(mine[0]["ts"] - step["ts"]) < 0.01
        assert abs(mine[2]["ts"] + mine[2]["dur"] - step["ts"] - step["dur"]) < 0.01
    # reader work: an epoch's shuffle each, and reads of exactly this rank's rows
    reader = _spans(rank0, "reader")
    assert {e["tid"] for e in reader} == {3}
    assert sum(e["name"] == "shuffle" for e in reader) >= 2
    reads = [e for e in reader if e["name"] == "read"]
    assert sum(e["args"]["rows"] for e in reads) == 2 * STEPS * 8, reads[:3]
    buckets = [e for e in _spans(rank0, "collective") if "tensors" in e["args"]]
    grads = [b for b in buckets if b["args"]["num_tensors"] == 6]
    # one bucket per step: the gradients, the step's rows count and its commit vote
    assert len(grads) == 2 * STEPS, len(grads)
    assert sorted(grads[0]["args"]["tensors"]) == sorted(
        ["matex/rows", "matex/vote", "sequential/dense/kernel", "sequential/dense/bias",
         "sequential/dense_1/kernel", "sequential/dense_1/bias"]), grads[0]["args"]["tensors"]
    assert grads[0]["args"]["bytes"] == (2 + 8 * 16 + 16 + 16 * 2 + 2) * 4
    # the monitor: rank 0's lines, and the figures in every rank's History
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("matex monitor: step ")]
    assert lines, proc.stderr[-3000:]
    assert all("samples/s; slowest rank " in ln and "% of step" in ln for ln in lines)
    for r in range(2):
        with open(tmp_path / ("out.%d.json" % r)) as f:
            history = json.load(f)["history"]
        assert len(history["loss"]) == 2
        assert all(v > 0 for v in history["matex_samples_per_s"])
        assert all(v in (0, 1) for v in history["matex_slowest_rank"])
        assert all(v >= 0 for v in history["matex_slowest_lag_ms"])
        assert all(0 < v < 1 for v in history["matex_allreduce_share"])


def test_sampling_records_only_the_requested_steps(tmp_path):
    proc = _matexrun(tmp_path, "--timeline", "tl", "--timeline-steps", "5-7")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "matex monitor" not in proc.stderr   # off unless asked for
    merged, _ = _check_traces(tmp_path / "tl", 2)
    for r in range(2):
        mine = [e for e in merged if e["pid"] == r]
        steps = _spans(mine, "step")
        assert sorted(e["args"]["step"] for e in steps) == [5, 6, 7]
        windows = [(s["ts"], s["ts"] + s["dur"]) for s in steps]
        collectives = _spans(mine, "collective")
        assert len(collectives) == sum(s["args"]["collectives"] for s in steps) > 0
        for c in collectives:   # every recorded collective lies inside a sampled step
            assert any(lo <= c["ts"] and c["ts"] + c["dur"] <= hi for lo, hi in windows), c


def test_api_start_stop_on_three_ranks(tmp_path):
    proc = _matexrun(tmp_path, nranks=3, script_args=["api"], env={"TEST_STEPS": "30-32"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    merged, comms = _check_traces(tmp_path / "out.timeline", 3)
    # ranks 0 and 1 ran 5 allreduces on a sub-communicator of theirs in step 31: paired among
    # themselves, and the world's collectives still pair across all 3 ranks (before: by each
    # process's count, rank 2's collectives paired with the others' later ones)
    assert [c for c in comms if c[0] == [0, 1]] == [([0, 1], 5)], comms
    assert [c[0] for c in comms] == [[0, 1], [0, 1, 2]], comms
    steps = _spans(merged, "step")   # a custom loop's, marked with matex.timeline.step
    assert sorted(e["args"]["step"] for e in steps) == [30, 30, 30, 31, 31, 31, 32, 32, 32]
    assert all(e["args"]["collectives"] >= 1 for e in steps)   # its gradient allreduce
    assert len(_spans(merged, "phase")) == 3 * len(steps)


def test_unwritable_directory_fails_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _matexrun(tmp_path, "--timeline", str(blocker / "tl"), timeout=60)
    assert proc.returncode == 2
    assert "cannot write the timeline to %s" % (blocker / "tl") in proc.stderr, proc.stderr
    assert not (tmp_path / "out.0.json").exists()
    # set through the environment: every rank fails at MaTEx's start, before training
    proc = _matexrun(tmp_path, env={"MATEX_TIMELINE": str(blocker / "tl")}, timeout=120)
    assert proc.returncode != 0
    assert "TimelineError: rank 0: matex.timeline: cannot write the timeline to" in proc.stderr
    assert not (tmp_path / "out.0.json").exists() and not (tmp_path / "out.1.json").exists()


@pytest.mark.parametrize("text", ["7-3", "abc", "1-2-3", "-4", ""])
def test_malformed_step_range_is_a_clear_error(tmp_path, text):
    proc = _matexrun(tmp_path, "--timeline", "tl", "--timeline-steps", text, timeout=60)
    assert proc.returncode == 2
    assert "--timeline-steps" in proc.stderr and repr(text) in proc.stderr, proc.stderr
    with pytest.raises(ValueError, match="MATEX_TIMELINE_STEPS"):
        _config.parse_step_range(text)


def test_step_range_parsing():
    assert _config.parse_step_range("100-120") == (100, 120)
    assert _config.parse_step_range(" 7 ") == (7, 7)


def test_merge_of_a_directory_without_timelines(tmp_path):
    with pytest.raises(TimelineError, match="no timeline files"):
        _merge.merge(tmp_path)
    cli = subprocess.run([sys.executable, "-m", "matex.timeline", "merge", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "no timeline files" in cli.stderr


def test_merge_reads_a_file_its_rank_never_closed(tmp_path):
    lines = ['[', '{"ph":"M","pid":0,"tid":0,"name":"matex_timeline","args":'
             '{"format":"matex-timeline/1","job":"j","origin_s":1.0}},',
             '{"ph":"X","pid":0,"tid":1,"name":"x","cat":"step","ts":1,"dur":2},',
             '{"ph":"X","pid":0,"tid":1,"na']
    (tmp_path / "timeline-rank0.json").write_text("\n".join(lines))
    path, ranks, count = _merge.merge(tmp_path)
    assert ranks == [0] and count == 2
    assert [e["name"] for e in json.loads(path.read_text())] == ["matex_timeline", "x"]
