"""The one place MaTEx touches Keras/TensorFlow internals: all of it still there?

A Keras upgrade that moves a private name MaTEx relies on fails here, with the
name, instead of somewhere inside training.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from matex import _compat


def test_every_private_name_matex_relies_on_exists():
    assert _compat.check() == []


def test_private_attributes_exist_on_fresh_instances(tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    for name in _compat.BACKUP_ATTRIBUTES:
        assert hasattr(backup, name), name
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable([1.0])])
    for name in _compat.OPTIMIZER_ATTRIBUTES:
        assert hasattr(optimizer, name), name
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((2, 2), "float32"), np.ones((2, 1), "float32"), verbose=0)
    for name in _compat.MODEL_ATTRIBUTES:
        assert hasattr(model, name), name
    assert model.layers[0] in _compat.flatten_layers(model)


def test_fit_still_hands_evaluate_the_keyword_matex_drops_on_a_redo():
    import inspect

    source = inspect.getsource(_compat.tf_trainer_class().fit)
    assert _compat.EVALUATE_CACHED_KEYWORD in source


def test_installed_versions_are_the_tested_ones():
    # Not a pin of the install (setup.py allows a range): this says which
    # versions the suite ran with, so a run on others is visibly untested.
    version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    low, high = _compat.TESTED_KERAS
    assert low <= version <= high, keras.__version__
    version = tuple(int(p) for p in tf.__version__.split(".")[:2])
    low, high = _compat.TESTED_TENSORFLOW
    assert low <= version <= high, tf.__version__


def test_tf_keras_private_names_exist_and_version_is_the_tested_one():
    """Keras 2 (matex.legacy._keras2): the tf-keras internals it uses, the tested version."""
    tf_keras = pytest.importorskip("tf_keras")
    assert _compat.check_tf_keras() == []
    version = tuple(int(p) for p in tf_keras.__version__.split(".")[:2])
    low, high = _compat.TESTED_TF_KERAS
    assert low <= version <= high, tf_keras.__version__
    assert all(callable(getattr(cls, name))
               for cls, name in _compat.tf_keras_training_entry_points())
    momentum = tf_keras.optimizers.legacy.SGD(momentum=0.9)   # the instance's _hyper
    assert _compat.tf_keras_has_hyperparameter(momentum, "momentum")
    assert not _compat.tf_keras_has_hyperparameter(tf_keras.optimizers.SGD(momentum=0.9),
                                                   "momentum")


def test_keras_tuner_internals_exist_on_a_fresh_oracle(tmp_path):
    import keras_tuner as kt

    version = tuple(int(p) for p in kt.__version__.split(".")[:2])
    low, high = _compat.TESTED_KERAS_TUNER
    assert low <= version <= high, kt.__version__
    space = kt.HyperParameters()
    space.Float("x", 0.0, 1.0)
    oracle = kt.oracles.RandomSearchOracle(objective=kt.Objective("score", "min"), max_trials=2,
                                           hyperparameters=space, seed=0)
    oracle._set_project_dir(str(tmp_path), "compat")
    for name in _compat.ORACLE_ATTRIBUTES:
        assert hasattr(oracle, name), name


def test_a_weightless_model_writes_the_file_keras_writes(tmp_path):
    """matex.parallel's streamed save: a model built in weightless_build has variables
    without values (Keras's lazy variables), and keras_file_layout writes the .keras file
    model.save writes (members, config, HDF5 groups, dataset shapes and attributes) once
    its datasets are filled: plain load_model reads it and predicts the same."""
    import re
    import zipfile

    import h5py

    def make():
        return keras.Sequential([keras.Input((5,), name="x"), keras.layers.Dense(7, name="a"),
                                 keras.layers.BatchNormalization(name="bn"),
                                 keras.layers.Dense(3, name="b")], name="m")

    model = make()
    model.save(tmp_path / "keras.keras")
    with _compat.weightless_build():
        lazy = make()
    assert [tuple(v.shape) for v in lazy.weights] == [tuple(v.shape) for v in model.weights]
    assert all(v._value is None for v in lazy.weights)      # no memory behind them
    h5_path = str(tmp_path / "weights.h5")
    with zipfile.ZipFile(tmp_path / "matex.keras", "w") as archive:
        h5, pairs, member = _compat.keras_file_layout(lazy, archive, h5_path)
        value = {id(w): v for w, v in zip(lazy.weights, model.weights)}
        for variable, dataset in pairs:
            dataset[...] = np.asarray(value[id(variable)])
        h5.close()
        archive.write(h5_path, member)

    def contents(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            # the same config but for the id Keras gives each shared object
            config = re.sub(rb'"shared_object_id": \d+', b"", archive.read("config.json"))
            with archive.open("model.weights.h5") as f, h5py.File(f) as h5:
                items = []
                h5.visititems(lambda name, obj: items.append(
                    (name, dict(obj.attrs), getattr(obj, "shape", None),
                     getattr(obj, "dtype", None))))
        return names, config, items

    assert contents(tmp_path / "matex.keras") == contents(tmp_path / "keras.keras")
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    loaded = keras.models.load_model(tmp_path / "matex.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
