"""matex.science's training tools under mpiexec: neuron apoptosis and YinYang sample pruning."""

import os
import sys
import tempfile

import h5py
import keras
import numpy as np
import pytest
from helpers import gather

import matex
from matex.science import NeuronApoptosis, SamplePruning, count_shrunk_params, shrink_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from shapes import make_shapes  # noqa: E402

RANK, SIZE = matex.rank(), matex.size()


def _compile(model, lr=3e-3, **kwargs):
    model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.Adam(lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)
    return model


def test_apoptosis_same_units_on_every_rank_stay_dead_and_shrink_exactly():
    x, y = make_shapes(800, seed=1)
    share = len(x) // SIZE
    x, y = x[RANK * share:(RANK + 1) * share], y[RANK * share:(RANK + 1) * share]
    keras.utils.set_random_seed(RANK)          # different init per rank: rank 0's wins
    model = _compile(keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(12, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu", name="conv_b"),
        keras.layers.Flatten(),
        keras.layers.Dense(48, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(4),
    ]))
    # a high relative threshold makes deaths certain within a few epochs
    cb = NeuronApoptosis(x[:128], threshold=0.6, patience=1, warmup=0, max_fraction=0.5,
                         verbose=False)
    model.fit(x, y, batch_size=64 // SIZE, epochs=3, verbose=0, callbacks=[cb])
    dead = {name: np.flatnonzero(m < 0.5) for name, m in cb.masks.items()}
    assert sum(len(d) for d in dead.values()) > 0, cb.history
    assert set(cb.masks) == {lay.name for lay in model.layers
                             if isinstance(lay, (keras.layers.Conv2D, keras.layers.Dense))} - {
        model.layers[-1].name}
    # every rank killed the same units
    everyone = gather({n: d.tolist() for n, d in dead.items()})
    assert all(e == everyone[0] for e in everyone), everyone
    # train on without new checks: dead units stay exactly zero, live ones keep learning
    before = {lay.name: lay.kernel.numpy().copy() for lay in model.layers if lay.name in dead}
    cb.interval = 10 ** 6
    model.fit(x, y, batch_size=64 // SIZE, epochs=2, verbose=0, callbacks=[cb])
    for name, idx in dead.items():
        lay = model.get_layer(name)
        kernel, bias = lay.kernel.numpy(), lay.bias.numpy()
        assert np.all(kernel[..., idx] == 0) and np.all(bias[idx] == 0), name
        alive = np.setdiff1d(np.arange(kernel.shape[-1]), idx)
        assert not np.allclose(kernel[..., alive], before[name][..., alive]), name
    # the physically smaller model computes the same outputs, parameters reported correctly
    small = cb.shrink()
    probe = x[:200]
    np.testing.assert_allclose(small.predict(probe, verbose=0), model.predict(probe, verbose=0),
                               atol=1e-5)
    assert cb.params_before == model.count_params()
    assert cb.params_after == small.count_params() < cb.params_before
    assert cb.history[-1]["params_after"] == cb.params_after
    for name, idx in dead.items():
        assert small.get_layer(name).kernel.shape[-1] == len(cb.masks[name]) - len(idx)


def test_shrink_model_functional_chain_folds_constant_outputs():
    # sigmoid(0) = 0.5: removed units still feed a constant into the next layer (folded into
    # its bias); a 'valid' convolution after an elu+1-like constant; a functional chain
    rng = np.random.default_rng(0)
    inp = keras.Input((10, 10, 2))
    h = keras.layers.Conv2D(6, 3, activation="sigmoid", name="c1")(inp)
    h = keras.layers.Conv2D(5, 3, activation="relu", name="c2")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(7, activation="sigmoid", name="d1")(h)
    out = keras.layers.Dense(3, name="d2")(h)
    model = keras.Model(inp, out)
    masks = {"c1": np.array([1, 0, 1, 1, 0, 1], bool), "c2": np.array([0, 1, 1, 1, 1], bool),
             "d1": np.array([1, 1, 0, 1, 0, 0, 1], bool)}
    for name, keep in masks.items():
        lay = model.get_layer(name)
        lay.kernel.assign(lay.kernel.numpy() * keep)
        lay.bias.assign(rng.normal(size=keep.shape).astype(np.float32) * keep)
    small = shrink_model(model, masks)
    xs = rng.normal(size=(16, 10, 10, 2)).astype(np.float32)
    np.testing.assert_allclose(small(xs).numpy(), model(xs).numpy(), atol=1e-5)
    assert small.count_params() == count_shrunk_params(model, masks) < model.count_params()
    with pytest.raises(ValueError, match="output layer"):
        shrink_model(model, {"d2": np.array([1, 0, 1], bool)})


def test_bad_thresholds_raise_on_every_rank():
    x = np.zeros((8, 4), np.float32)
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="threshold"):
            NeuronApoptosis(x, threshold=bad)
    with pytest.raises(ValueError, match="patience"):
        NeuronApoptosis(x, patience=0)
    y = np.zeros(64, np.int64)
    xs = np.zeros((64, 4), np.float32)
    with pytest.raises(ValueError, match="margin"):
        SamplePruning((xs, y), batch_size=8, margin=-1.0)
    with pytest.raises(ValueError, match="loss_threshold"):
        SamplePruning((xs, y), batch_size=8, loss_threshold=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        SamplePruning((xs, y), batch_size=8, margin=1.0, loss_threshold=0.5)
    with pytest.raises(ValueError, match="full_pass_every"):
        SamplePruning((xs, y), batch_size=8, margin=1.0, full_pass_every=0)
    with pytest.raises(ValueError, match="batch_size"):
        SamplePruning((xs, y), batch_size=SIZE * 8 + 1, margin=1.0)


_SEEN = []   # module-level: a list set on a Keras layer would be copied into a tracked one


class _Record(keras.layers.Layer):
    """Drops the id column; records the ids the model trains on (eager: run_eagerly=True)."""

    def call(self, inputs, training=None):
        if training:
            _SEEN.append(np.asarray(inputs[:, 0]).astype(np.int64))
        return inputs[:, 1:]


def test_pruning_equal_steps_kept_samples_once_and_periodic_full_pass():
    n, epochs, every = 600, 5, 3
    x, y = make_shapes(n, seed=3)
    x = np.concatenate([np.arange(n, dtype=np.float32)[:, None], x.reshape(n, -1)], axis=1)
    seen, log = _SEEN, []

    class Watch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.clear()
            self.steps = 0
            self.learned = pruning.learned.copy()

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

        def on_epoch_end(self, epoch, logs=None):
            ids = np.concatenate(seen) if seen else np.zeros(0, np.int64)
            log.append((self.steps, ids, self.learned))

    keras.utils.set_random_seed(0)
    model = _compile(keras.Sequential([keras.Input((257,)), _Record(),
                                       keras.layers.Dense(64, activation="relu"),
                                       keras.layers.Dense(4)]), run_eagerly=True)
    pruning = SamplePruning((x, y), batch_size=32, margin=0.5, full_pass_every=every,
                            verbose=False)
    history = model.fit(pruning.dataset(), epochs=epochs, verbose=0, shuffle=False,
                        callbacks=[pruning, Watch()])
    everyone = gather(log)
    fractions = []
    for epoch in range(epochs):
        steps = [r[epoch][0] for r in everyone]
        assert len(set(steps)) == 1, ("unequal steps", epoch, steps)
        ids = np.concatenate([r[epoch][1] for r in everyone])
        learned = everyone[0][epoch][2]
        assert all(np.array_equal(r[epoch][2], learned) for r in everyone)   # agreed flags
        full = epoch % every == 0
        expected = np.arange(n) if full else np.flatnonzero(~learned)
        # no padding rows here: every rank has more candidates than steps
        assert min(len(r[epoch][1]) for r in everyone) >= steps[0]
        assert len(ids) == len(np.unique(ids)), ("a sample seen twice", epoch)
        np.testing.assert_array_equal(np.sort(ids), expected)
        entry = pruning.history[epoch]
        assert entry["full_pass"] == full and entry["kept"] == len(expected)
        assert entry["fraction"] == pytest.approx(len(expected) / n)
        assert history.history["kept_fraction"][epoch] == pytest.approx(len(expected) / n)
        fractions.append(entry["fraction"])
    assert fractions[0] == fractions[every] == 1.0
    assert min(fractions) < 0.9, fractions        # pruning did happen
    assert np.all(gather(pruning.learned.tobytes())[0] == pruning.learned.tobytes())


def test_pruning_on_a_readers_dataset():
    from matex.readers import DataSet

    path = None
    if RANK == 0:
        path = os.path.join(tempfile.mkdtemp(prefix="matex-prune-"), "shapes.h5")
        x, y = make_shapes(512, seed=4)
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = x, y
    path = matex.comm().bcast(path, root=0)
    with DataSet(path, batch_size=32, shuffle=False) as ds:
        pruning = SamplePruning(ds, batch_size=32, margin=0.2, full_pass_every=2, verbose=False)
        assert pruning.num_samples == ds.num_samples
        keras.utils.set_random_seed(0)
        model = _compile(keras.Sequential([keras.Input((16, 16, 1)), keras.layers.Flatten(),
                                           keras.layers.Dense(32, activation="relu"),
                                           keras.layers.Dense(4)]))
        steps = []

        class Count(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.n = 0

            def on_train_batch_end(self, batch, logs=None):
                self.n += 1

            def on_epoch_end(self, epoch, logs=None):
                steps.append(self.n)

        model.fit(pruning.dataset(), epochs=3, verbose=0, callbacks=[pruning, Count()])
    everyone = gather(steps)
    assert all(s == everyone[0] for s in everyone), everyone
    assert [h["full_pass"] for h in pruning.history] == [True, False, True]
    assert pruning.history[1]["kept"] == pruning.num_samples - pruning.history[0][
        "learned_after"]
    if RANK == 0:
        os.remove(path)
