"""benchmarks/communication.py --quick runs end to end: over shared memory, and across
two network-namespace hosts whose links are shaped (``--network netns``).

Speed is not asserted (a timed test on a shared machine would be noise); the
table must hold a finite row per option, and the byte counts must show what
each option is: compressors and LocalSGD/DiLoCo send less than dense, delay=1
the same. In namespaces the shaping must be in force: the link the job
measures is capped (a 200 Mbit/s bucket, so that an unshaped veth, several
Gbit/s, cannot pass), and the namespaces are gone afterwards.
"""

import json
import math
import os
import subprocess
import sys

import pytest

import mpitools

ROOT = mpitools.ROOT
sys.path.insert(0, str(ROOT / "tests" / "netns"))
import nscluster  # noqa: E402


@pytest.fixture
def netns():
    reason = ("MATEX_TEST_NETNS=0" if os.environ.get("MATEX_TEST_NETNS") == "0"
              else nscluster.available())
    if reason:
        pytest.skip("network namespaces: " + reason)


def _run(tmp_path, *extra):
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "communication.py"),
                           "--quick", "--json", str(out)] + list(extra), cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, json.loads(out.read_text())


def _check_rows(results, stdout):
    assert {"dense", "localsgd", "diloco", "delay"} <= set(results)
    dense = results["dense"]["bytes_per_step"]
    for name, r in results.items():
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["params"] == results["dense"]["params"]
        assert ("| %s " % name) in stdout
    assert results["localsgd"]["bytes_per_step"] * 8 == dense
    assert results["delay"]["bytes_per_step"] == dense
    for name, least in (("fp16", 1.9), ("topk", 10), ("powersgd", 5)):
        if name in results:
            assert dense / results[name]["bytes_per_step"] >= least, (name, results[name])


def test_communication_quick_over_shared_memory(tmp_path):
    proc, results = _run(tmp_path)
    _check_rows(results, proc.stdout)
    assert "network: shm (2 ranks)" in proc.stdout


def _orphaned_namespaces():
    """Namespace hosts whose creating process is gone (others' live runs are not counted)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return {n for n in names if nscluster.NAME_RE.match(n)
            and not os.path.exists("/proc/%s" % nscluster.NAME_RE.match(n).group(1))}


def test_communication_quick_across_shaped_namespace_hosts(netns, tmp_path):
    before = _orphaned_namespaces()
    proc, runs = _run(tmp_path, "--network", "netns", "--rate", "200mbit")
    assert list(runs) == ["netns 200mbit"]
    results = runs["netns 200mbit"]
    _check_rows(results, proc.stdout)
    assert "network: netns 200mbit (2 ranks)" in proc.stdout
    assert "shaping in force: tbf rate 200mbit" in proc.stdout
    assert "netem is " in proc.stdout
    # the bucket holds: well under an unshaped veth, and traffic did flow
    assert 0.01 < results["dense"]["link_gbit"] < 0.3, results["dense"]
    assert _orphaned_namespaces() <= before, "namespaces left behind"
