"""Data slicing under real mpiexec: the "already sharded" mark and run-time rank/size.

``tests/mpi/test_batch_slicing.py`` (2 and 3 ranks) checks the mark on
tf.data chains, slicing after the communicator is replaced, and what
fit/evaluate/predict hand Keras (empty slices and BatchNormalization, a
model's own train_step, lists of inputs, shuffling of resumed epochs);
``tests/scripts/sharded_chains.py`` trains plain Keras on chains after a
reader and after ``matex.shard`` under ``python -m matex`` and counts, inside
the model, every sample each rank trained and validated on.
``tests/scripts/uneven_steps.py`` filters batches after sharding so that the
ranks get different numbers of steps: one clear error on every rank.
"""

import json
import os
import sys

import h5py
import numpy as np
import pytest

import mpitools

ROOT = mpitools.ROOT
CHAINS_SCRIPT = str(ROOT / "tests" / "scripts" / "sharded_chains.py")
UNEVEN_SCRIPT = str(ROOT / "tests" / "scripts" / "uneven_steps.py")
# chain -> (training steps per epoch, validation samples per epoch); None: all of them
CHAINS = {
    "plain": (None, None),
    "map": (None, None),
    "prefetch": (None, None),
    "map.prefetch": (None, None),
    "cache": (None, None),
    "take": (-2, 16),
    "repeat.take": (None, None),
    "map.cache.repeat": (None, None),
    "map.take.cache.repeat.prefetch": (-1, None),
}


@pytest.mark.parametrize("nranks", [2, 3])
def test_batch_slicing_suite(nranks, tmp_path):
    assert mpitools.run_suite(nranks, ["test_batch_slicing.py"], tmp_path) >= 24


def write_data(path, total=128):
    rng = np.random.default_rng(0)
    ids = np.arange(total, dtype=np.float32)[:, None]
    x = np.concatenate([ids, rng.normal(size=(total, 4)).astype(np.float32)], axis=1)
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = rng.integers(0, 3, total)


def test_chains_after_reader_and_shard_train_on_every_sample_once(tmp_path):
    data = tmp_path / "data.h5"
    write_data(data)
    out = str(tmp_path / "chains.json")
    nranks = 2
    proc = mpitools.run_mpi(nranks, [sys.executable, "-m", "matex", CHAINS_SCRIPT, out,
                                     str(data), "reader,shard", ",".join(CHAINS)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    runs = [json.load(open("%s.%d" % (out, r))) for r in range(nranks)]
    first = runs[0]
    split, total, batch, steps = first["split"], first["total"], first["global_batch"], \
        first["steps"]
    assert first["size"] == nranks
    problems = []
    for source in ("reader", "shard"):
        for chain, (step_change, validated) in CHAINS.items():
            key = "%s/%s" % (source, chain)
            results = [run["results"][key] for run in runs]
            seen = np.array([r["seen"] for r in results])      # rank, epoch, sample id
            vseen = np.array([r["vseen"] for r in results])
            epoch_steps = steps + (step_change or 0)
            for epoch in range(seen.shape[1]):
                trained = seen[:, epoch].sum(0)
                validated_ids = vseen[:, epoch].sum(0)
                # every training sample exactly once per epoch (or, for chains that take
                # a part, that many distinct samples once); never a validation sample
                want = len(range(split)) if step_change is None else epoch_steps * batch
                if not (set(np.unique(trained[:split])) <= {0.0, 1.0}
                        and trained[:split].sum() == want and not trained[split:].any()):
                    problems.append("%s epoch %d: trained on %d samples (want %d once each),"
                                    " counts %s" % (key, epoch, trained.sum(), want,
                                                    sorted(set(trained.tolist()))))
                vwant = total - split if validated is None else validated
                if not (set(np.unique(validated_ids)) <= {0.0, 1.0}
                        and validated_ids[split:].sum() == vwant
                        and not validated_ids[:split].any()):
                    problems.append("%s epoch %d: validated on %d samples (want %d once each)"
                                    % (key, epoch, validated_ids.sum(), vwant))
                # sharded, not repeated: each rank its half of every global batch
                for rank in range(nranks):
                    if seen[rank, epoch].sum() != want / nranks:
                        problems.append("%s epoch %d: rank %d trained on %d samples, want %d"
                                        % (key, epoch, rank, seen[rank, epoch].sum(),
                                           want / nranks))
                    if results[rank]["steps"][epoch] != epoch_steps:
                        problems.append("%s epoch %d: rank %d ran %d steps, want %d"
                                        % (key, epoch, rank, results[rank]["steps"][epoch],
                                           epoch_steps))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", ["shard", "reader"])
def test_uneven_steps_after_a_filter_is_one_clear_error_on_every_rank(source, tmp_path):
    extra = [str(tmp_path / "uneven.h5")] if source == "reader" else []
    out = str(tmp_path / "raised")
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", UNEVEN_SCRIPT, source] + extra,
                            timeout=300, env={**os.environ, "UNEVEN_OUT": out})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "finished rank" not in output, output[-5000:]
    # every rank raised the same clear error (each wrote it before the job ended)
    for rank in (0, 1):
        raised = open("%s.%d" % (out, rank)).read()
        assert raised.startswith("MismatchError: matex: ranks ran different numbers of "
                                 "training steps"), raised
        assert "rank 0 had no batch left after 1 steps; rank 1 had more" in raised
