"""benchmarks/communication.py --quick runs end to end over shared memory (2 ranks).

Speed is not asserted (a timed test on a shared machine would be noise); the
table must hold a finite row per option, and the byte counts must show what
each option is: compressors and LocalSGD/DiLoCo send less than dense, delay=1
the same. Network namespaces are not used here (the script has no such mode:
see README "Communicating less").
"""

import json
import math
import os
import subprocess
import sys

import mpitools

ROOT = mpitools.ROOT


def test_communication_quick_over_shared_memory(tmp_path):
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "communication.py"),
                           "--quick", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert {"dense", "localsgd", "diloco", "delay"} <= set(results)
    dense = results["dense"]["bytes_per_step"]
    for name, r in results.items():
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["params"] == results["dense"]["params"]
        assert ("| %s " % name) in proc.stdout
    assert results["localsgd"]["bytes_per_step"] * 8 == dense
    assert results["delay"]["bytes_per_step"] == dense
    for name, least in (("fp16", 1.9), ("topk", 10), ("powersgd", 5)):
        if name in results:
            assert dense / results[name]["bytes_per_step"] >= least, (name, results[name])
    assert "network: shm" in proc.stdout
