"""Horovod's elastic states on MaTEx (#25 item 6), under mpiexec without failures.

What a failure run cannot pin down: ``sync`` takes the state of the rank with
the most commits (ULFM may leave one survivor a commit ahead of another);
``commit``/``restore``/``sync`` of a Keras model and its optimizer; the
write-through to disk every N commits; ``run`` starting from a commit a
previous launch left on disk. (Rank failures: tests/test_elastic.py.)
"""

import os
import re
import pickle

import keras
import numpy as np

import matex
import matex.horovod.tensorflow.keras as hvd
from matex.horovod import elastic
from helpers import all_equal_bytes, gather

R, N = matex.rank(), matex.size()


def test_sync_takes_the_state_of_the_rank_with_the_most_commits():
    state = elastic.ObjectState(value=R, history=[R])
    state.commit()
    if R == N - 1:   # the last rank committed one step more than the others
        state.value, state.history = 100 + R, [R, 100 + R]
        state.commit()
    state.value = -1   # uncommitted: never synchronised
    elastic._sync(state)
    assert (state.value, state.history) == (100 + N - 1, [N - 1, 99 + N])
    assert state._commits == 2
    state.value = 7
    state.restore()   # back to the commit sync took
    assert state.value == 100 + N - 1


def _model():
    keras.utils.set_random_seed(R)   # different weights on every rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    return model, keras.optimizers.Adam(0.1)


def test_keras_state_commit_restore_and_sync():
    model, optimizer = _model()
    state = hvd.elastic.KerasState(model, optimizer, epoch=R)
    assert optimizer.built and len(state._saved_values) == len(model.variables) + len(
        optimizer.variables)   # the optimizer's slots are in every commit
    state.sync()
    assert state.epoch == 0 and all_equal_bytes(model.get_weights())
    synced = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in synced])
    state.epoch = 5
    state.restore()                      # nothing committed since sync: back to it
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), synced))
    assert state.epoch == 0
    # one step of the optimizer (its slots move too), committed
    optimizer.apply([np.ones(v.shape, "float32") for v in model.trainable_variables],
                    model.trainable_variables)
    state.epoch = 1
    state.commit()
    committed = [v.numpy().copy() for v in model.variables + list(optimizer.variables)]
    optimizer.apply([np.ones(v.shape, "float32") for v in model.trainable_variables],
                    model.trainable_variables)
    state.epoch = 2
    state.restore()
    now = [v.numpy() for v in model.variables + list(optimizer.variables)]
    assert all(np.array_equal(a, b) for a, b in zip(now, committed))
    assert state.epoch == 1 and int(optimizer.iterations.numpy()) == 1
    # the commit as data (what goes to disk) rebuilds the state in a fresh model
    other, other_optimizer = _model()
    fresh = hvd.elastic.KerasState(other, other_optimizer, epoch=0)
    fresh.load_committed(pickle.loads(pickle.dumps(state.committed())))
    assert fresh.epoch == 1
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(
        other.variables + list(other_optimizer.variables), committed))


def test_keras_state_takes_the_accumulation_count_from_the_rank_with_the_most_commits():
    """``backward_passes_per_step``'s counter comes from the same survivor as the model:
    the one with the most commits (before, the counter always came from rank 0, so a
    survivor a commit ahead took rank 0's older count with its own newer model)."""
    import tensorflow as tf

    model, _ = _model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=3)
    optimizer.build(model.trainable_variables)
    reduction = optimizer._matex.strategy
    reduction.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    state = hvd.elastic.KerasState(model, optimizer)
    state.commit()
    if R == N - 1:   # the last rank counted one call more, and committed it
        reduction.counter.assign(2)
        state.commit()
    else:
        reduction.counter.assign(1)
    elastic._sync(state)
    assert int(reduction.counter.numpy()) == 2 and state._commits == 2
    assert all_equal_bytes(model.get_weights())


def _shared_dir(tmp_path):
    """Rank 0's temporary directory, named to every rank (one machine)."""
    return matex.broadcast_object(str(tmp_path), 0)


def test_commits_are_written_through_every_n_on_rank_0(tmp_path, monkeypatch):
    directory = _shared_dir(tmp_path)
    monkeypatch.setenv("MATEX_CHECKPOINT_DIR", directory)
    monkeypatch.setenv(elastic.WRITE_EVERY_VAR, "2")

    def train(state):
        pass

    path = elastic.state_file(train)
    assert os.path.dirname(path) == directory and re.search(r"\.train-[0-9a-f]{12}\.pkl$",
                                                            path), path
    state = elastic.ObjectState(step=0)
    state._file = path
    written = []
    for step in range(1, 4):
        state.step = step
        state.commit()
        gather(None)   # rank 0 has written before anyone looks
        written.append(pickle.load(open(path, "rb")) if os.path.exists(path) else None)
        gather(None)
    assert written == [None, {"commits": 2, "state": {"step": 2}},
                       {"commits": 2, "state": {"step": 2}}]   # every 2nd commit only


def test_run_starts_from_the_commit_a_previous_launch_left(tmp_path, monkeypatch):
    directory = _shared_dir(tmp_path)
    monkeypatch.setenv("MATEX_CHECKPOINT_DIR", directory)
    seen = []

    def train(state):
        seen.append((state.step, state.log))
        state.step += 1
        state.commit()
        return state.step

    run = elastic.run(train)
    path = elastic.state_file(train)
    if R == 0:
        with open(path, "wb") as f:
            pickle.dump({"commits": 7, "state": {"step": 7, "log": ["from disk"]}}, f)
    gather(None)
    state = elastic.ObjectState(step=0, log=[])
    assert run(state) == 8
    assert seen == [(7, ["from disk"])]   # every rank: rank 0 read it, sync gave it
    gather(None)
    assert not os.path.exists(path)       # removed once train returned


def test_an_unreadable_commit_file_is_one_error_on_every_rank(tmp_path, monkeypatch):
    import pytest

    from matex._everywhere import RemoteError

    directory = _shared_dir(tmp_path)
    monkeypatch.setenv("MATEX_CHECKPOINT_DIR", directory)

    def train(state):
        raise AssertionError("never called")

    path = elastic.state_file(train)
    if R == 0:
        with open(path, "wb") as f:
            f.write(b"not a pickle")
    gather(None)
    with pytest.raises(RemoteError, match="hvd.elastic: resuming from .*: rank 0: "
                                          "UnpicklingError"):
        elastic.run(train)(elastic.ObjectState(step=0))
    gather(None)
