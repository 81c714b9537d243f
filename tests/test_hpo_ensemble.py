"""``matex.hpo.ensemble``: the average, its checks, saving, and exact evaluation on 2 ranks."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import mpitools
from matex.hpo import ensemble

SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "ensemble_evaluate.py")


def classifier(seed, features=4, classes=3, name=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(classes, activation="softmax")], name=name)


def two_headed(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5)(inputs)
    return keras.Model(inputs, [keras.layers.Dense(2)(hidden), keras.layers.Dense(1)(hidden)])


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).normal(size=(13, 4)).astype("float32")


def test_average_equals_the_manual_average(x):
    members = [classifier(s) for s in range(3)]
    alone = [m.predict(x, verbose=0) for m in members]
    assert not np.allclose(alone[0], alone[1])     # the members differ
    np.testing.assert_allclose(ensemble(members).predict(x, verbose=0), np.mean(alone, axis=0),
                               rtol=1e-6, atol=1e-7)
    # weights are normalised to sum 1
    weighted = ensemble(members, weights=[1, 2, 5]).predict(x, verbose=0)
    np.testing.assert_allclose(weighted, (alone[0] + 2 * alone[1] + 5 * alone[2]) / 8,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(weighted.sum(axis=1), 1, rtol=1e-6)   # still probabilities
    # one member: the ensemble is that member, whatever its weight
    np.testing.assert_allclose(ensemble(members[:1], [3.0]).predict(x, verbose=0), alone[0],
                               rtol=1e-6, atol=1e-7)
    # several outputs: each one averaged on its own
    heads = [two_headed(s) for s in (5, 6)]
    outs = [m.predict(x, verbose=0) for m in heads]
    got = ensemble(heads, [3, 1]).predict(x, verbose=0)
    assert len(got) == 2
    for i in range(2):
        np.testing.assert_allclose(got[i], 0.75 * outs[0][i] + 0.25 * outs[1][i],
                                   rtol=1e-6, atol=1e-6)


def test_members_frozen_by_default_and_renamed_when_names_clash(x):
    members = [classifier(s, name="trial") for s in range(3)]
    model = ensemble(members)
    assert [m.name for m in members] == ["trial", "trial_2", "trial_3"]
    assert model.trainable_weights == [] and not any(m.trainable for m in members)
    assert len(model.non_trainable_weights) == 3 * 4
    thawed = ensemble([classifier(s) for s in range(2)], trainable=True)
    assert len(thawed.trainable_weights) == 2 * 4
    # the same model twice counts twice, as one shared layer
    twice = ensemble([members[0], members[0], members[1]])
    np.testing.assert_allclose(
        twice.predict(x, verbose=0),
        (2 * members[0].predict(x, verbose=0) + members[1].predict(x, verbose=0)) / 3,
        rtol=1e-6, atol=1e-7)


def test_fed_by_a_keras_tuner_search(tmp_path, x):
    import keras_tuner as kt

    y = (x[:, 0] > 0).astype("int64")

    def build(hp):   # no keras.Input: the tuner builds the models on the data
        model = keras.Sequential([keras.layers.Dense(hp.Int("units", 2, 8), activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    tuner = kt.RandomSearch(build, objective="val_loss", max_trials=3, seed=1,
                            directory=str(tmp_path), overwrite=True)
    tuner.search(x, y, epochs=1, validation_data=(x, y), verbose=0)
    best = tuner.get_best_models(2)
    alone = np.mean([m.predict(x, verbose=0) for m in best], axis=0)
    model = ensemble(best)
    assert len({m.name for m in best}) == 2     # both were "sequential" here: renamed
    np.testing.assert_allclose(model.predict(x, verbose=0), alone, rtol=1e-6, atol=1e-7)


def test_bad_input_is_a_clear_error():
    a, b = classifier(0), classifier(1)
    cases = [
        (([],), ValueError, "at least one model"),
        ((a,), TypeError, "list of Keras models"),
        (([a, "b"],), TypeError, "member 1 is a str"),
        (([a, classifier(2, features=5)],), ValueError, "member 1's inputs"),
        (([a, classifier(2, classes=4)],), ValueError, "member 1's outputs"),
        (([a, b], [1.0]), ValueError, "1 weights for 2 models"),
        (([a, b], [1.0, 0.0]), ValueError, "weight 1 is 0.0"),
        (([a, b], [-1.0, 2.0]), ValueError, "weight 0 is -1.0"),
        (([a, b], [1.0, float("nan")]), ValueError, "weight 1 is nan"),
        (([a, b], "12"), TypeError, "weights must be a list"),
        (([a, keras.Sequential([keras.layers.Dense(3)])],), ValueError,
         "member 1 .* has no defined inputs"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            ensemble(*args)


def test_save_and_load_give_identical_predictions(tmp_path, x):
    model = ensemble([classifier(s, name="m") for s in range(3)], weights=[0.2, 0.3, 0.5])
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    expected = model.predict(x, verbose=0)
    path = tmp_path / "ensemble.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    # a fresh process that imports neither MaTEx nor anything custom
    code = ("import json, sys, keras, numpy as np; m = keras.saving.load_model(sys.argv[1]); "
            "print(json.dumps({'p': m.predict(np.load(sys.argv[2]), verbose=0).tolist(), "
            "'compiled': m.compiled, 'modules': sorted(k for k in sys.modules "
            "if k.startswith('matex'))}))")
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.npy")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.splitlines()[-1])
    assert fresh["modules"] == [] and fresh["compiled"]
    np.testing.assert_array_equal(np.array(fresh["p"], dtype="float32"), expected)


def test_evaluate_on_2_ranks_equals_1_process(tmp_path):
    out = str(tmp_path)
    proc = subprocess.run([sys.executable, SCRIPT, out, "reference"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.load(open(tmp_path / "reference.0.json"))
    proc = mpitools.run_mpi(2, [sys.executable, SCRIPT, out, "matex"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    # the ensembles differ from each other, so the comparisons below can tell them apart
    assert one["equal"]["loss"] != pytest.approx(one["weighted"]["loss"], rel=1e-3)
    assert one["names"] == ["member", "member_2", "member_3"]
    for rank in range(2):
        many = json.load(open(tmp_path / ("matex.%d.json" % rank)))
        assert many["names"] == one["names"]
        assert many["frozen"] == [True] * 3 and many["trainable_weights"] == 0
        for key in ("equal", "weighted", "saved"):
            assert sorted(many[key]) == ["accuracy", "loss"]
            np.testing.assert_allclose(many[key]["loss"], one[key]["loss"], rtol=1e-6,
                                       err_msg=key)
            # 101 rows: an accuracy is a count of 101, exact
            assert round(many[key]["accuracy"] * 101) == round(one[key]["accuracy"] * 101)
            np.testing.assert_allclose(many[key]["accuracy"], one[key]["accuracy"], rtol=1e-7)
            # predict gathers every row on every rank
            np.testing.assert_allclose(many[key + "_predict"], one[key + "_predict"],
                                       rtol=1e-6, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(many["members_predict"], one["members_predict"],
                                   rtol=1e-6, atol=1e-7)
        # the saved (weighted) ensemble, loaded under MaTEx, is the weighted one rebuilt
        assert many["saved"] == pytest.approx(many["weighted"], rel=1e-7)
