"""TF1 graph collectives under real mpiexec (tests/mpi/test_legacy_graph.py, 2 and 3 ranks),
and a meta graph exported by a 2-rank run imported and run by a plain process (no mpiexec):
its inference part, and one of its collectives as a single rank."""

import os
import subprocess
import sys

import pytest

import mpitools

IMPORT_AND_PREDICT = """
import sys
import numpy as np
{first}
directory = sys.argv[1]
with tf.Graph().as_default() as g, tf.compat.v1.Session(graph=g) as s:
    saver = tf.compat.v1.train.import_meta_graph(directory + "/model.meta")
    saver.restore(s, directory + "/model")
    types = {{op.type for op in g.get_operations()}}
    assert {{"MatexAllreduce", "MatexBroadcast"}} <= types, types
    got = s.run("pred:0", {{"x:0": np.arange(6, dtype="float32").reshape(2, 3)}})
    # a collective of the imported graph runs too, as one rank (MPI's singleton)
    bcast = [op for op in g.get_operations() if op.type == "MatexBroadcast"][0]
    value, sent = s.run([bcast.outputs[0], bcast.inputs[0]])
    np.testing.assert_array_equal(value, sent)
np.testing.assert_allclose(got, np.load(directory + "/predicted.npy"), rtol=1e-6)
print("PREDICTED", got.ravel().tolist())
"""


@pytest.mark.parametrize("nranks", [2, 3])
def test_graph_collectives_suite(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_legacy_graph.py"], tmp_path) >= 14


@pytest.mark.parametrize("first", ["import matex\nimport tensorflow as tf",
                                   "import tensorflow as tf\nimport matex"])
def test_meta_graph_from_a_2_rank_run_imports_in_a_plain_process(first, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    env = dict(os.environ, MATEX_TEST_EXPORT_DIR=str(export))
    mpitools.run_suite(2, ["test_legacy_graph.py::test_export_a_trained_meta_graph_for_a_plain_"
                           "process"], tmp_path / "reports", env=env)
    assert (export / "model.meta").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX"))}
    proc = subprocess.run([sys.executable, "-c", IMPORT_AND_PREDICT.format(first=first),
                           str(export)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(mpitools.ROOT))
    assert proc.returncode == 0 and "PREDICTED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
