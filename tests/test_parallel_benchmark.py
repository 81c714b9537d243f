"""benchmarks/model_parallel.py --quick --only tensor runs end to end: finite figures,
half the parameters per rank, and the bytes each layout hands to collectives (facts of
the layout, not of timing)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tensor_parallel_benchmark_quick(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MATEX_FLIGHT_DIR=str(tmp_path / "flight"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_parallel.py"), "--quick",
         "--only", "tensor", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    rep, tp = results["tensor_replicated"], results["tensor_tensor"]
    for r in (rep, tp):
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
    assert abs(tp["parameter_bytes"] / rep["parameter_bytes"] - 0.5) < 0.01
    # the forward allreduce of batch x width float32 (the backward one, of the input's
    # gradient, is pruned: the block's input is data)
    activations = 4 * tp["batch"] * tp["width"]
    assert activations <= tp["bytes_per_step"] < activations * 1.01
    # replicated: every gradient once
    assert rep["parameter_bytes"] <= rep["bytes_per_step"] < rep["parameter_bytes"] * 1.01
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| replicated")
            or line.startswith("| tensor")]
    assert len(rows) == 2, proc.stdout
    assert "each rank holds about half the parameters: MET" in proc.stdout
    # peak memory per rank: building the weights, and (tensor) gathering them to rank 0
    assert "build peak MB per rank" in proc.stdout and "Gathering the tensor-parallel" in \
        proc.stdout
    assert all(r["build_peak_bytes"] >= 0 for r in (rep, tp))
    assert tp["gather_peak_root_bytes"] >= 0 and tp["gather_peak_other_bytes"] >= 0
    # and saving it as one .keras file, streamed (per rank) and the previous way (rank 0)
    assert "Saving it as one .keras file" in proc.stdout
    assert len(tp["save_peak_bytes"]) == 2 and min(tp["save_peak_bytes"]) >= 0
    assert tp["whole_save_peak_bytes"] >= 0 and tp["model_bytes"] == 4 * (
        8 * tp["width"] ** 2 + 5 * tp["width"])


def test_pipeline_bubble_benchmark_quick(tmp_path):
    """--quick --only pipeline: P = 2 at M = 1 and 4, finite figures against the same
    run's one-process step, and the ideal bubble printed beside them."""
    out = tmp_path / "pp.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MATEX_FLIGHT_DIR=str(tmp_path / "flight"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_parallel.py"), "--quick",
         "--only", "pipeline", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(out.read_text())["bubble_P2"]
    assert sorted(int(m) for m in r["pipeline_s"]) == [1, 4]
    assert all(math.isfinite(v) and v > 0 for v in r["pipeline_s"].values())
    assert math.isfinite(r["reference_s"]) and r["reference_s"] > 0
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| 2 ")]
    assert [row[1].strip() for row in rows] == ["1", "4"], proc.stdout
    assert [row[6].strip() for row in rows] == ["2.00", "1.25"]   # (M + P - 1) / M
