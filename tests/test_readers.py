"""matex.readers: the multi-rank suites under real mpiexec on 1 to 4 ranks, and the benchmark."""

import json
import math
import subprocess
import sys
from pathlib import Path

import mpitools

ROOT = Path(__file__).resolve().parent.parent


def test_readers_suite(tmp_path):
    """The suites on 4, 3, 1 and 2 ranks, in one 4-rank job (tests/scripts/suite_layouts.py):
    the whole world, then groups of 3 and 1 side by side, then 2 ranks; each rank starts
    TensorFlow once, not once per rank count (10 starts in 4 jobs before)."""
    script = str(ROOT / "tests" / "scripts" / "suite_layouts.py")
    proc = mpitools.run_mpi(4, [sys.executable, script, str(tmp_path), "4;3,1;2",
                                "test_readers.py", "test_readers_streaming.py"], timeout=1200)
    errors, counts = [], {}
    for group, ranks in (("0-0", [0, 1, 2, 3]), ("1-0", [0, 1, 2]), ("1-1", [3]),
                         ("2-0", [0, 1])):
        n = len(ranks)
        try:
            counts[n] = mpitools.check_reports(tmp_path / group, n, proc)
            seen = json.loads((tmp_path / group / "group.json").read_text())
            assert seen == {"size": n, "world_ranks": ranks}, seen   # the suites' matex.size()
        except AssertionError as exc:
            errors.append("%d rank(s): %s" % (n, exc))
    assert not errors, "\n\n".join(errors)
    assert sorted(counts) == [1, 2, 3, 4] and min(counts.values()) >= 44, counts


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
