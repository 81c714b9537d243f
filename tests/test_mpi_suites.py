"""The multi-rank suites under real mpiexec: 2 and 3 ranks, shared memory and TCP."""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import mpitools

ROOT = Path(__file__).resolve().parent.parent

TCP = ["--mca", "btl", "tcp,self"]


COLLECTIVES = ["test_collectives.py", "test_training.py",
               "test_adasum.py",    # after a traced optimizer step
               "test_process_sets.py"]
KERAS_API = ["test_keras_api.py", "test_runtime.py", "test_horovod_training.py",
             "test_horovod_elastic.py"]
# test_replacing_the_communicator_frees_the_ones_it_replaces installs MPI.COMM_WORLD.Dup()
# as MaTEx's communicator: on ranks 0-1 of 3 that Dup waits for rank 2 for ever.
WORLD_ONLY = ["test_runtime.py"]


def _tests_in(report, module):
    """How many tests of ``module`` a rank's JUnit report ran (skipped ones left out)."""
    return sum(1 for case in ET.parse(report).getroot().iter("testcase")
               if case.get("classname", "").split(".")[0] == module.removesuffix(".py")
               and case.find("skipped") is None)


def test_collectives_and_keras_api_on_3_and_2_ranks(tmp_path):
    """Both suites on 3 and on 2 ranks in two jobs, 5 TensorFlow start-ups instead of 10
    in 4 jobs. The 3-rank job (tests/scripts/suite_layouts.py) runs the collectives suites
    on 3 ranks, then the keras_api suites on 3, then on 2 (ranks 0-1 on a sub-communicator
    installed as MaTEx's, rank 2 waiting): matex.keras patches Keras once imported, so the
    keras_api suites come after the others, in a later pytest run (one pytest over both
    would import test_keras_api, hence matex.keras, while collecting, before test_training's
    XLA tests, which then fail). The collectives suites run once per process:
    test_training imports matex.keras (test_fit_does_not_read_the_step_counter...), after
    which its XLA tests (test_xla_split_matches_plain_step, the xla-split fit) meet the
    patched metrics' allreduce inside the jit-compiled step and fail. So they run on 2 ranks
    in a 2-rank job of their own, with test_runtime.py (WORLD_ONLY) after them."""
    script = str(ROOT / "tests" / "scripts" / "suite_layouts.py")
    proc = mpitools.run_mpi(3, [sys.executable, script, str(tmp_path), "3"] + COLLECTIVES
                            + ["--", "3"] + KERAS_API
                            + ["--", "2"] + [f for f in KERAS_API if f not in WORLD_ONLY],
                            timeout=1800)
    counts = mpitools.check_groups(tmp_path, proc, {"0-0": [0, 1, 2], "1-0": [0, 1, 2],
                                                    "2-0": [0, 1]})
    two = mpitools.run_suite(2, COLLECTIVES + WORLD_ONLY, tmp_path / "2-ranks")
    alone = sum(_tests_in(tmp_path / "2-ranks" / "rank0.xml", f) for f in WORLD_ONLY)
    assert alone > 0, alone
    assert counts["0-0"] >= 140 and two - alone >= 140, (counts, two, alone)   # collectives
    assert counts["1-0"] >= 20 and counts["2-0"] + alone >= 20, (counts, alone)  # keras_api


def test_collectives_and_training_over_tcp(tmp_path):
    count = mpitools.run_suite(2, COLLECTIVES, tmp_path, mpi_args=TCP)
    assert count >= 140


@pytest.mark.parametrize("nranks", [2, 3])
def test_core_without_tensorflow(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_core.py"], tmp_path) >= 25


