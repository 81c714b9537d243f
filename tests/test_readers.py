"""matex.readers: the multi-rank suites under real mpiexec on 1 to 4 ranks, and the benchmark."""

import json
import math
import subprocess
import sys
from pathlib import Path

import mpitools

ROOT = Path(__file__).resolve().parent.parent


def test_readers_suite(tmp_path):
    for n in (1, 2, 3, 4):
        count = mpitools.run_suite(n, ["test_readers.py", "test_readers_streaming.py"],
                                   tmp_path / str(n))
        assert count >= 44


def test_benchmark_quick(tmp_path):
    out = tmp_path / "readers.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readers.py"), "--quick",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=mpitools.launch.launch_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == (1 + 17) + (1 + 3), proc.stdout      # two tables: header and rows
    targets = [line for line in proc.stdout.splitlines() if line.startswith("- ")]
    assert len(targets) == 3 and all(": MET (" in t or ": MISSED (" in t for t in targets)
    results = json.loads(out.read_text())
    assert set(results) == {"ranks1", "ranks2", "memory"}
    figures = [v for phase in ("ranks1", "ranks2") for kind in results[phase].values()
               for v in kind.values()]
    assert figures and all(math.isfinite(v) and v > 0 for v in figures)
