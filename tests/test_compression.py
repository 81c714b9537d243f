"""Communicating less (#14, part A) under real mpiexec: the sparse allreduce on 2, 3 and 4
ranks (power of two and not), the compressors in DistributedOptimizer on 2 ranks, and the
sparse-allreduce benchmark's --quick driver."""

import math

import pytest

import mpitools
from test_benchmarks import numbers, run_driver


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_sparse_allreduce(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_sparse_allreduce.py"], tmp_path) >= 25


def test_compressors(tmp_path):
    assert mpitools.run_suite(2, ["test_compression.py"], tmp_path) >= 17


def test_sparse_allreduce_benchmark(tmp_path):
    stdout, results = run_driver("sparse_allreduce", tmp_path, timeout=600)
    results = results["worker"]
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(lines) == 3 * 2 + 7 + 6 + 2, stdout   # three tables: header, rule, rows
    assert sum(1 for line in stdout.splitlines() if ": MET (" in line or ": MISSED (" in line) == 1
    assert all(math.isfinite(n) and n >= 0 for n in numbers(results))
    assert "crossover density (scalar rows)" in stdout
    emb = results["embedding"]
    assert emb["sparse_bytes"] < emb["densified_bytes"]
    for key in ("scalar", "rows16"):
        for row in results[key].values():
            assert row["sparse_ms"] > 0 and row["dense_ms"] > 0 and row["allgather_ms"] > 0


def test_compression_select_benchmark(tmp_path):
    stdout, results = run_driver("compression_select", tmp_path, timeout=600)
    r = results["worker"]
    assert set(r["select_ms"]) == {"randomk_draws", "randomk_ranking", "topk"}
    assert set(r["reduce_ms"]) == {"randomk", "topk"}
    assert all(math.isfinite(v) and v > 0 for d in (r["select_ms"], r["reduce_ms"])
               for v in d.values())
    assert r["k"] == math.ceil(0.01 * r["n"])
    assert sum(1 for line in stdout.splitlines() if ": MET (" in line or ": MISSED (" in line) == 1
