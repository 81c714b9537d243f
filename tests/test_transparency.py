"""User transparency: unmodified scripts and `import matex.keras`, under real mpiexec."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mpitools

ROOT = mpitools.ROOT
SCRIPT = str(ROOT / "tests" / "scripts" / "keras_fit.py")


def _single(tmp_path, *args):
    out = str(tmp_path / "one.json")
    subprocess.run([sys.executable, SCRIPT, out] + list(args), check=True, timeout=300,
                   capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    return json.load(open(out + ".0"))


def _distributed(tmp_path, nranks, *args):
    out = str(tmp_path / "many.json")
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", SCRIPT, out] + list(args),
                            timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.load(open("%s.%d" % (out, r))) for r in range(nranks)]


@pytest.mark.parametrize("nranks,kind,n,batch", [
    (2, "arrays", 96, 16),       # even split
    (3, "arrays", 101, 16),      # batch not divisible by ranks, partial last batch
    (3, "dataset", 50, 8),       # tf.data of global batches
    (2, "generator", 45, 10),    # Python generator
    (3, "pydataset", 40, 7),     # keras.utils.PyDataset, 40 % 7 != 0
])
def test_unmodified_script_matches_one_process(tmp_path, nranks, kind, n, batch):
    one = _single(tmp_path, kind, str(n), str(batch))
    many = _distributed(tmp_path, nranks, kind, str(n), str(batch))
    # identical weights on every rank (bitwise), close to the 1-process run
    for other in many[1:]:
        assert other["weights"] == many[0]["weights"]
    for a, b in zip(one["weights"], many[0]["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(many[0]["loss"], one["loss"], rtol=1e-4)
    # every sample trained on exactly once per epoch, by exactly one rank
    seen = np.array([m["seen"] for m in many])
    assert seen.sum(0).tolist() == [3.0] * n
    for r in range(nranks):
        share = seen[r].sum() / 3
        assert abs(share - n / nranks) <= -(-n // batch), (r, share)
    # exact global metrics and complete, ordered predictions
    for m in many:
        np.testing.assert_allclose(m["evaluate"], one["evaluate"], rtol=1e-5)
        np.testing.assert_allclose(np.array(m["pred"]), np.array(one["pred"]), rtol=1e-4,
                                   atol=1e-5)


def test_shuffled_epochs_are_disjoint_across_ranks_and_equal_to_one_process(tmp_path):
    many = _distributed(tmp_path, 2, "arrays", "64", "16", "shuffle")
    seen = np.array([m["seen"] for m in many])
    assert seen.sum(0).tolist() == [3.0] * 64
    # shuffled: a rank does not see the same samples every epoch
    assert set(np.unique(seen[0])) - {0.0, 3.0}


def test_import_swap_example_writes_once_prints_once_and_reloads(tmp_path):
    rank_dirs = [tmp_path / ("r%d" % r) for r in range(2)]
    for d in rank_dirs:
        d.mkdir()
    # each rank runs in its own directory: a file in r1/ would mean rank 1 wrote
    wrapper = tmp_path / "in_rank_dir.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "os.chdir(os.path.join(%r, 'r' + os.environ['OMPI_COMM_WORLD_RANK']))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n" % str(tmp_path))
    example = str(ROOT / "examples" / "keras_import_swap.py")
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", "--all-ranks", str(wrapper),
                                example, "out"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    files0 = sorted(os.listdir(rank_dirs[0] / "out"))
    assert files0 == ["best.keras", "final.keras", "log.csv"]
    assert os.listdir(rank_dirs[1] / "out") == []        # made by the script, never written
    rows = (rank_dirs[0] / "out" / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 4                                # header + 3 epochs, written once
    lines = proc.stdout.splitlines()
    rank1 = [l for l in lines if l.startswith("[rank 1]")]
    assert not any("Epoch" in l or "step" in l for l in rank1), rank1
    assert any(l.startswith("Epoch 1/3") for l in lines)
    assert "[rank 1] restored model agrees: True" in lines
    accuracy = [float(l.split()[-1]) for l in lines if "test accuracy" in l]
    assert len(accuracy) == 2 and accuracy[0] == accuracy[1] and accuracy[0] > 0.6


def _last_number(text, prefix):
    return [float(l.split()[-1]) for l in text.splitlines() if l.startswith(prefix)]


@pytest.mark.parametrize("example,key,rtol", [
    # fit shuffles: same meaning, another permutation than Keras's own RNG
    ("tf_keras_unmodified.py", "accuracy", 0.03),
    # no sharding in custom loops: identical to one process up to rounding
    ("gradient_tape_unmodified.py", "weights checksum", 1e-4),
])
def test_unmodified_tf_examples_train_identically_on_all_ranks(example, key, rtol):
    path = str(ROOT / "examples" / example)
    single = subprocess.run([sys.executable, path], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", "--all-ranks", path],
                            timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    checksums = (_last_number(proc.stdout, "weights checksum")
                 + _last_number(proc.stdout, "[rank 1] weights checksum"))
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    np.testing.assert_allclose(_last_number(proc.stdout, key), _last_number(single.stdout, key),
                               rtol=rtol)


def test_demo_explicit_use_is_not_sharded_twice_under_matexrun():
    # demo.py shards its own data and wraps its optimizer itself: under
    # python -m matex its fit/predict must keep their inputs as given.
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    proc = subprocess.run([matexrun, "-n", "2", str(ROOT / "examples" / "demo.py"),
                           "--epochs", "2", "--samples", "6000"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "weights identical on all ranks: True" in proc.stdout
    accuracy = _last_number(proc.stdout, "test accuracy")
    assert len(accuracy) == 1 and accuracy[0] > 0.85, proc.stdout[-2000:]
