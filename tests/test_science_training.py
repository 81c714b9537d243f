"""matex.science training tools (#16, part B) under real mpiexec, and one tiny recipe run."""

import csv
import subprocess
import sys

import pytest

import mpitools


def test_apoptosis_and_pruning_on_2_ranks(tmp_path):
    assert mpitools.run_suite(2, ["test_science_training.py"], tmp_path,
                              env=_env(tmp_path)) >= 5


def _env(tmp_path):
    import os

    env = dict(os.environ)
    env["MATEX_FLIGHT_DIR"] = str(tmp_path / "flight")
    return env


def test_recipe_reports_every_run_with_median_and_spread(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "matex.bench", "shapes", "--seeds", "2",
                           "--ranks", "1,2", "--samples", "256", "--epochs", "1",
                           "--target", "0.3", "--out", str(out)],
                          cwd=mpitools.ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list(csv.DictReader(open(out / "runs.csv")))
    assert sorted((int(r["ranks"]), int(r["seed"])) for r in runs) == [(1, 0), (1, 1),
                                                                        (2, 0), (2, 1)]
    summary = list(csv.DictReader(open(out / "summary.csv")))
    assert [int(s["ranks"]) for s in summary] == [1, 2]
    for s in summary:
        mine = [r for r in runs if r["ranks"] == s["ranks"]]
        assert int(s["runs"]) == len(mine) == 2
        for fig in ("test_accuracy", "samples_per_s", "train_time_s"):
            values = sorted(float(r[fig]) for r in mine)
            assert float(s[fig + "_median"]) == pytest.approx(sum(values) / 2)
            assert float(s[fig + "_min"]) == pytest.approx(values[0])
            assert float(s[fig + "_max"]) == pytest.approx(values[-1])
        for r in mine:
            assert 0.0 <= float(r["test_accuracy"]) <= 1.0 and float(r["samples_per_s"]) > 0
    one = [float(r["samples_per_s"]) for r in runs if r["ranks"] == "1"]
    for r in runs:    # efficiency against the median 1-rank throughput
        expected = float(r["samples_per_s"]) / (int(r["ranks"]) * (sum(one) / 2))
        assert float(r["scaling_efficiency"]) == pytest.approx(expected)
    every, medians = (out / "report.md").read_text().split("## Median")
    assert every.count("\n| plain | 1 | ") == 2 and every.count("\n| plain | 2 | ") == 2
    assert medians.count("\n| plain | 1 | 2 | ") == 1 and medians.count("\n| plain | 2 | 2 | ") == 1
    assert (out / "report.png").stat().st_size > 1000
    # bad input: a clear error, no traceback
    bad = subprocess.run([sys.executable, "-m", "matex.bench", "shapes", "--ranks", "0",
                          "--out", str(out)], cwd=mpitools.ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "rank counts must be >= 1" in bad.stderr
