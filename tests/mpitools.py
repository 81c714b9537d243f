"""Run pytest suites under a real mpiexec and check every rank's report."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from matex import launcher as launch

ROOT = Path(__file__).resolve().parent.parent


def run_mpi(nranks, program, mpi_args=(), timeout=900, env=None, cwd=ROOT):
    """Run ``program`` (a list) on ``nranks`` ranks; return the CompletedProcess."""
    cmd = launch.mpiexec_command(nranks, program, mpi_args=mpi_args)
    full_env = launch.launch_env(env)
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:   # a launch that failed transiently to start is retried
        return launch.run_captured(cmd, env=full_env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("timed out after %ss: %s\n%s\n%s" % (
            timeout, " ".join(cmd), (exc.stdout or "")[-3000:], (exc.stderr or "")[-5000:]))


def run_suite(nranks, files, report_dir, mpi_args=(), timeout=1200, env=None):
    """Run pytest on ``files`` under mpiexec; assert all ranks ran the same tests, all passed.

    Returns the number of tests each rank ran.
    """
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env or os.environ)
    env["MATEX_TEST_REPORT_DIR"] = str(report_dir)
    program = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-c", str(ROOT / "tests" / "mpi" / "pytest.ini")] + [
        str(ROOT / "tests" / "mpi" / f) for f in files]
    proc = run_mpi(nranks, program, mpi_args=mpi_args, timeout=timeout, env=env)
    return check_reports(report_dir, nranks, proc)


def check_reports(report_dir, nranks, proc):
    """Assert ``report_dir`` holds ``nranks`` rank reports, all passed, all the same tests,
    and that the job (``proc``) exited 0. Returns the number of tests each rank ran."""
    reports = sorted(Path(report_dir).glob("rank*.xml"))
    problems = []
    names = {}
    for path in reports:
        root = ET.parse(path).getroot()
        cases = root.iter("testcase")
        ran, bad = [], []
        for case in cases:
            name = case.get("classname", "") + "::" + case.get("name", "")
            if case.find("skipped") is not None:
                continue
            ran.append(name)
            for tag in ("failure", "error"):
                node = case.find(tag)
                if node is not None:
                    bad.append("%s %s: %s\n%s" % (path.stem, name, node.get("message", ""),
                                                  (node.text or "")[-3000:]))
        names[path.stem] = ran
        problems += bad
    log = (proc.stdout + proc.stderr)[-6000:]
    for path in sorted(Path(report_dir).glob("rank*.log")):
        text = path.read_text()
        if text:   # a timed-out test's stack dump begins with the test's own frame
            log += "\n--- %s ---\n%s" % (path.name, text[:3000] if path.name.endswith(
                "-timeout.log") else text[-3000:])
    assert len(reports) == nranks, (
        "expected %d rank reports, found %d (exit %d)\n%s" % (nranks, len(reports),
                                                              proc.returncode, log))
    assert not problems, "\n\n".join(problems) + "\n" + log
    sets = {tuple(v) for v in names.values()}
    assert len(sets) == 1, "ranks ran different tests: %s" % names
    count = len(next(iter(sets)))
    assert count > 0, "no test ran\n" + log
    assert proc.returncode == 0, "mpiexec exited %d\n%s" % (proc.returncode, log)
    return count


def check_groups(report_dir, proc, groups):
    """``check_reports`` for each group of a ``tests/scripts/suite_layouts.py`` job, plus
    its group.json: the suites ran on a communicator of that size and those world ranks.

    ``groups`` maps a group's folder (``"<layout>-<group>"``) to its world ranks. Every
    group is checked before one AssertionError lists them all; returns {folder: count}.
    """
    errors, counts = [], {}
    for group, ranks in groups.items():
        try:
            counts[group] = check_reports(Path(report_dir) / group, len(ranks), proc)
            seen = json.loads((Path(report_dir) / group / "group.json").read_text())
            assert seen == {"size": len(ranks), "world_ranks": list(ranks)}, seen
        except (AssertionError, OSError) as exc:
            errors.append("%s, %d rank(s): %s" % (group, len(ranks), exc))
    assert not errors, "\n\n".join(errors)
    return counts
