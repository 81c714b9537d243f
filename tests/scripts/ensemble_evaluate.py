"""Test script: an ensemble of three models evaluated in 1 process and under MaTEx.

Usage: ensemble_evaluate.py DIR reference   (plain Keras, one process)
       ensemble_evaluate.py DIR matex       (import matex.keras, under mpiexec)

``reference`` trains three small classifiers (all named "member", as models
loaded from separate files often are), saves them and a weighted ensemble of
them to DIR, and records the evaluation and predictions of an equal-weight
and the weighted ensemble. ``matex`` loads the members and the saved
ensemble on every rank, builds both ensembles again, and records the same.
The data has 101 rows (odd) and batch size 16, so the rows split unevenly
over 2 ranks and the last batch is short. Writes DIR/<mode>.<rank>.json.
"""

import json
import os
import sys

import numpy as np

from matex.hpo import ensemble

out, mode = sys.argv[1], sys.argv[2]
if mode == "matex":
    import matex.keras as keras
else:
    import keras

WEIGHTS = [1.0, 2.0, 5.0]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
rng = np.random.default_rng(0)
x = rng.normal(size=(101, 6)).astype("float32")
y = (np.argmax(x[:, :3], axis=1) + (x[:, 3] > 1)).astype("int64") % 3


def compiled(model):
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


if mode == "reference":
    members = []
    for seed in range(3):
        keras.utils.set_random_seed(seed)
        member = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                   keras.layers.Dense(3, activation="softmax")], name="member")
        member.compile(optimizer=keras.optimizers.SGD(0.05),
                       loss="sparse_categorical_crossentropy")
        member.fit(x, y, batch_size=16, epochs=2 + seed, shuffle=False, verbose=0)
        member.save(os.path.join(out, "member%d.keras" % seed))
        members.append(member)
    saved = compiled(ensemble(members, WEIGHTS))
    saved.save(os.path.join(out, "weighted.keras"))
else:
    members = [keras.saving.load_model(os.path.join(out, "member%d.keras" % i))
               for i in range(3)]
    saved = keras.saving.load_model(os.path.join(out, "weighted.keras"))

equal = compiled(ensemble(members))
weighted = compiled(ensemble(members, WEIGHTS))
result = {"names": [m.name for m in members], "frozen": [not m.trainable for m in members],
          "trainable_weights": len(weighted.trainable_weights)}
for key, model in (("equal", equal), ("weighted", weighted), ("saved", saved)):
    result[key] = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    result[key + "_predict"] = model.predict(x, batch_size=16, verbose=0).tolist()
result["members_predict"] = [m.predict(x, batch_size=16, verbose=0).tolist() for m in members]
with open(os.path.join(out, "%s.%d.json" % (mode, rank)), "w") as f:
    json.dump(result, f)
