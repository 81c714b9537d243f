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
    """The script under mpiexec and python -m matex: every rank's result."""
    out = str(tmp_path / ("many%d.json" % nranks))
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", SCRIPT, out] + list(args),
                            timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.load(open("%s.%d" % (out, r))) for r in range(nranks)]


def _each_sample_once_per_epoch(runs, batch):
    """Every sample trained (validated) on exactly once per epoch, by exactly one rank.

    ``runs``: one kind's result on every rank.
    """
    nranks = len(runs)
    for key, ids in (("seen", runs[0]["train_ids"]), ("vseen", runs[0]["val_ids"])):
        counts = np.array([run[key] for run in runs])           # rank, epoch, sample id
        expected = np.zeros(counts.shape[1:])
        expected[:, ids] = 1.0
        np.testing.assert_array_equal(counts.sum(0), expected, err_msg=key)
        # sharded, not repeated: each rank holds about 1/N of every epoch
        for r in range(nranks):
            for share in counts[r].sum(1):
                assert abs(share - len(ids) / nranks) <= -(-len(ids) // batch), (key, r, share)


@pytest.mark.parametrize("nranks,kinds,n,batch", [
    # batch divisible by the ranks, partial last batches (arrays: 67 rows after the split)
    (2, "arrays,generator", 90, 16),
    # batch not divisible by the ranks, partial last batch; tf.data and PyDataset
    (3, "arrays,dataset,pydataset", 101, 16),
])
def test_unmodified_script_matches_one_process(tmp_path, nranks, kinds, n, batch):
    # Every process seeds itself with its rank: ranks build different initial
    # weights, the single process builds rank 0's.
    one = _single(tmp_path, kinds, str(n), str(batch))
    many = _distributed(tmp_path, nranks, kinds, str(n), str(batch))
    for kind in kinds.split(","):
        ref, runs = one[kind], [m[kind] for m in many]
        assert runs[1]["initial"] != runs[0]["initial"] and runs[0]["initial"] == ref["initial"]
        # rank 0's initial weights (and optimizer) everywhere: identical weights on every
        # rank (bitwise), close to the 1-process run
        for other in runs[1:]:
            assert other["weights"] == runs[0]["weights"], kind
        for a, b in zip(ref["weights"], runs[0]["weights"]):
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4, atol=1e-6,
                                       err_msg=kind)
        # training and validation data sharded: each sample once per epoch
        _each_sample_once_per_epoch(runs, batch)
        # fit's history (training and validation metrics) is the 1-process one
        for run in runs:
            assert sorted(run["history"]) == ["accuracy", "loss", "val_accuracy", "val_loss"]
            for key, values in ref["history"].items():
                np.testing.assert_allclose(run["history"][key], values, rtol=1e-4,
                                           err_msg="%s %s" % (kind, key))
        # exact global metrics and complete, ordered predictions
        for run in runs:
            np.testing.assert_allclose(run["evaluate"], ref["evaluate"], rtol=1e-5)
            np.testing.assert_allclose(np.array(run["pred"]), np.array(ref["pred"]),
                                       rtol=1e-4, atol=1e-5)


def test_unseeded_shuffling_script_uses_every_sample_once_per_epoch(tmp_path):
    # No seed anywhere: fit(shuffle=True) on arrays and a PyDataset (Keras would
    # shuffle PyDataset batches with each rank's own `random`), an unseeded
    # tf.data .shuffle(), a generator drawing from np.random and random. MaTEx
    # seeds those generators alike on every rank before the script runs.
    kinds = ["arrays", "dataset", "generator", "pydataset"]
    many = _distributed(tmp_path, 3, ",".join(kinds), "50", "8", "shuffle", "unseeded")
    for kind in kinds:
        runs = [m[kind] for m in many]
        # same seed for Keras's initializers on every rank
        assert all(run["initial"] == runs[0]["initial"] for run in runs), kind
        assert all(run["weights"] == runs[0]["weights"] for run in runs), kind
        _each_sample_once_per_epoch(runs, 8)
        # shuffled: the step at which each sample is trained changes between epochs
        when = np.array([run["when"] for run in runs]).sum(0)        # epoch, sample
        assert (when[0] != when[1]).any() and (when[1] != when[2]).any(), kind


def test_shuffled_trajectory_does_not_depend_on_the_number_of_ranks(tmp_path):
    # fit(shuffle=True): MaTEx permutes the rows (arrays) and the batch order
    # (PyDataset) with one seed that rank 0 draws from the script's NumPy
    # generator. Ranks seed themselves differently (so Keras's own PyDataset
    # shuffle would differ per rank); one process under MaTEx draws rank 0's
    # seed, hence trains on the same global batches in the same order.
    kinds = ["arrays", "pydataset"]
    one = _distributed(tmp_path, 1, ",".join(kinds), "64", "12", "shuffle")[0]
    many = _distributed(tmp_path, 2, ",".join(kinds), "64", "12", "shuffle")
    for kind in kinds:
        ref, runs = one[kind], [m[kind] for m in many]
        _each_sample_once_per_epoch(runs, 12)
        when = np.array([run["when"] for run in runs]).sum(0)        # epoch, sample
        assert (when[0] != when[1]).any() and (when[1] != when[2]).any(), kind
        np.testing.assert_array_equal(when, ref["when"], err_msg=kind)
        assert runs[1]["weights"] == runs[0]["weights"], kind
        for a, b in zip(ref["weights"], runs[0]["weights"]):
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4, atol=1e-6,
                                       err_msg=kind)
        for key, values in ref["history"].items():
            np.testing.assert_allclose(runs[0]["history"][key], values, rtol=1e-4,
                                       err_msg="%s %s" % (kind, key))


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
    # (BackupAndRestore's backup/ is removed by rank 0 when training ends)
    assert files0 == ["best.keras", "final.keras", "final.weights.h5", "log.csv"]
    # made by the script, never written: no checkpoint, log, backup (rank 1 never
    # removes one), saved model or weights
    assert os.listdir(rank_dirs[1] / "out") == []
    rows = (rank_dirs[0] / "out" / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 4                                # header + 3 epochs, written once
    lines = proc.stdout.splitlines()
    rank1 = [line for line in lines if line.startswith("[rank 1]")]
    assert not any("Epoch" in line or "step" in line or "\u2501" in line for line in rank1), rank1
    assert any(line.startswith("Epoch 1/3") for line in lines)
    assert any("\u2501" in line and "step" in line for line in lines)     # rank 0's progress bar
    assert "[rank 1] restored model agrees: True" in lines
    accuracy = [float(line.split()[-1]) for line in lines if "test accuracy" in line]
    assert len(accuracy) == 2 and accuracy[0] == accuracy[1] and accuracy[0] > 0.6


def _last_number(text, prefix):
    return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("example,key,rtol", [
    # fit shuffles: same meaning, another permutation than Keras's own RNG
    ("tf_keras_unmodified.py", "accuracy", 0.03),
    # every rank iterates the whole dataset: the averaged gradient is the 1-process one
    ("gradient_tape_unmodified.py", "epoch 5 loss", 1e-4),
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


def test_custom_loop_starts_from_rank0_and_applies_averaged_gradients(tmp_path):
    # An unmodified GradientTape loop (`from tensorflow import keras`, Adam,
    # tf.function): ranks seed themselves differently and train on their own
    # data. Every step must apply the average of the ranks' gradients to rank
    # 0's initial weights: what the 1-process reference computes explicitly.
    script = str(ROOT / "tests" / "scripts" / "tape_loop.py")
    out = str(tmp_path / "tape.json")
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", script, out], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    runs = [json.load(open("%s.%d" % (out, r))) for r in range(2)]
    subprocess.run([sys.executable, script, str(tmp_path / "ref.json"), "2"], check=True,
                   timeout=300, capture_output=True,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    ref = json.load(open(str(tmp_path / "ref.json.0")))
    assert runs[0]["initial"] == ref["initial"] and runs[1]["initial"] != ref["initial"]
    assert runs[1]["weights"] == runs[0]["weights"]                  # bitwise
    assert runs[0]["iterations"] == runs[1]["iterations"] == ref["iterations"] == 18
    for a, b in zip(ref["weights"], runs[0]["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6)
    # rank 0's first loss is on its own data, from its own (= rank 0's) weights
    np.testing.assert_allclose(runs[0]["losses"], ref["losses"], rtol=1e-5)
    assert runs[1]["losses"] != runs[0]["losses"]                    # data differ per rank


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


def test_at_one_rank_the_traced_steps_are_plain_keras_ops_and_train_the_same_weights():
    """One process, no mpiexec: after ``import matex.keras``, ``fit``'s training step and a
    custom loop's step with ``DistributedGradientTape`` have exactly plain Keras's ops (no
    collective, no rows weighting, no first-step broadcast: #33's parity at one rank), and
    ``fit`` trains the same weights bitwise. Before, the step had 53 more ops (347 vs 294)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" /
                                               "one_rank_parity.py")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["same_weights"]
    for step in ("step_ops", "loop_ops"):
        plain, distributed = result["plain_" + step], result["matex_" + step]
        assert sum(plain.values()) > 100, plain   # the step was traced
        assert distributed == plain, {t: (plain.get(t, 0), distributed.get(t, 0))
                                      for t in set(plain) | set(distributed)
                                      if plain.get(t, 0) != distributed.get(t, 0)}
