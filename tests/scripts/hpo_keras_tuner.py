"""An ordinary Keras Tuner RandomSearch script (nothing MaTEx in the search itself).

    python -m matex tests/scripts/hpo_keras_tuner.py OUT DIRECTORY [max_trials] [overwrite]
                                                     [TUNER,...]

TUNER is ``random`` (the default: ``kt.RandomSearch``, project ``p``, records in
OUT.<rank>.json) or ``genetic`` / ``lazy-gp`` (``matex.hpo.GeneticSearch`` /
``LazyBayesianSearch``, project TUNER, records in OUT.TUNER.<rank>.json) or ``faulty``
(a RandomSearch whose trials raise on rank 1 of their group only: every third trial a
group runs in ``build``, the next in a ``fit`` callback; their peers wait in a
collective meanwhile); several run one after the other in the same job. With
MATEX_TEST_SEARCH_AGAIN=N, a second ``search`` of the same tuner follows with
max_trials N (records in OUT.again.<rank>.json).

What the test checks is recorded on the side, per world rank, in OUT.<rank>.json:
every fit this rank ran (hyperparameters, the size of the communicator it ran
on, a digest of the trained weights), the best hyperparameters and the best
model's weights digest as this rank sees them, and every file this process
wrote or created under DIRECTORY (Python's audit hook sees opens, mkdir,
rename/replace and removals; h5py's writes are recorded by wrapping h5py.File).
"""

import hashlib
import json
import os
import signal
import sys

import h5py
import keras
import keras_tuner as kt
import numpy as np

import matex

out, directory = sys.argv[1], os.path.abspath(sys.argv[2])
max_trials = int(sys.argv[3]) if len(sys.argv) > 3 else 6
overwrite = len(sys.argv) <= 4 or sys.argv[4] == "overwrite"
tuners = sys.argv[5].split(",") if len(sys.argv) > 5 else ["random"]
world_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
writes = set()


def _audit(event, args):
    if event == "open" and args[0] is not None and isinstance(args[0], (str, bytes)):
        path, mode = os.fsdecode(args[0]), args[1]
        if isinstance(mode, str) and any(c in mode for c in "wax+"):
            writes.add(path)
        elif isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            writes.add(path)
    elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir",
                   "shutil.rmtree"):
        writes.add(os.fsdecode(args[0]))


sys.addaudithook(_audit)
_h5_init = h5py.File.__init__


def _h5_file(self, name, mode="r", *args, **kwargs):
    if mode != "r":
        writes.add(os.fsdecode(name))
    return _h5_init(self, name, mode, *args, **kwargs)


h5py.File.__init__ = _h5_file

fits = []

if os.environ.get("MATEX_TEST_OWNER_DIES_IN_DRAIN"):
    # world rank 0, the oracle's owner, dies in the end-of-search drain: on the first
    # "finish" of its own group, while the other group may still need an owner
    from matex.hpo import _service

    _finish = _service.Handler.op_finish

    def _dying_finish(self, tuner_id, *args):
        if world_rank == 0 and tuner_id == "matex-group-0":
            print("matex: test: the oracle's owner dies in the drain", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return _finish(self, tuner_id, *args)

    _service.Handler.op_finish = _dying_finish


def digest(model):
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


class Record(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(digest(self.model))

    def on_train_end(self, logs=None):
        fits.append({"hp": current["hp"], "size": matex.size(), "group_rank": matex.rank(),
                     "digest": digest(self.model), "epochs": self.epochs})


current = {}


faulty = {"on": False, "n": 0, "kinds": {}}   # this rank's trials counted in run_trial


def fault_kind():
    """What the trial this rank runs now does on rank 1 of its group (faulty tuner only)."""
    if not faulty["on"]:
        return None
    return {1: "build", 2: "callback", 0: None}[faulty["n"] % 3]


searching = []   # set while tuner.search runs


def build(hp):
    if searching and os.environ.get("MATEX_TEST_KILL_IN_BUILD") == str(world_rank):
        # this rank dies as its first trial starts; its group's other rank goes on into fit
        print("matex: injecting fault (test script): rank %d killed in build" % world_rank,
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_kind() == "build" and matex.rank() == 1:
        raise ValueError("boom in build on world rank %d" % world_rank)
    units = hp.Int("units", 4, 64, step=4)
    lr = hp.Float("lr", 1e-3, 1e-1, sampling="log")
    current["hp"] = {"units": units, "lr": lr}
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


rng = np.random.default_rng(0)
x = rng.normal(size=(96, 4)).astype("float32")
y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")


class Faulty(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if fault_kind() == "callback" and matex.rank() == 1:
            raise ValueError("boom in callback on world rank %d" % world_rank)


class FaultySearch(kt.RandomSearch):
    def run_trial(self, trial, *args, **kwargs):
        faulty["n"] += 1
        faulty["kinds"][trial.trial_id] = fault_kind()
        return super().run_trial(trial, *args, **kwargs)


def make_tuner(name):
    common = dict(objective="val_accuracy", max_trials=max_trials, seed=3, directory=directory,
                  overwrite=overwrite)
    faulty["on"] = name == "faulty"
    if name == "random":
        return kt.RandomSearch(build, project_name="p", **common)
    if name == "faulty":
        return FaultySearch(build, project_name=name, max_consecutive_failed_trials=None,
                            **common)
    from matex import hpo

    if name == "genetic":
        return hpo.GeneticSearch(build, population_size=2, elitism=1, project_name=name,
                                 **common)
    return hpo.LazyBayesianSearch(build, num_initial_points=2, project_name=name, **common)


def search_and_record(tuner, name_part):
    fits.clear()
    writes.clear()
    searching.append(True)
    tuner.search(x, y, validation_split=0.25, epochs=2, batch_size=16, verbose=0,
                 callbacks=[Record()] + ([Faulty()] if faulty["on"] else []))
    searching.clear()
    faulty["on"] = False   # the best models are built again below
    best = tuner.get_best_hyperparameters(2)
    models = tuner.get_best_models(1)
    trials = tuner.oracle.get_best_trials(100)
    record = {"fits": fits, "best": [h.values for h in best], "best_digest": digest(models[0]),
              "trials": {t.trial_id: {"status": t.status, "hp": t.hyperparameters.values,
                                      "score": t.score, "message": t.message}
                         for t in trials},
              "writes": sorted(p for p in writes if os.path.abspath(p).startswith(directory)),
              "size": matex.size(), "kinds": faulty["kinds"],
              "all": {i: {"status": t.status, "message": t.message}
                      for i, t in tuner.oracle.trials.items()}}
    with open("%s.%s%d.json" % (out, name_part, world_rank), "w") as f:
        json.dump(record, f)


for name in tuners:
    tuner = make_tuner(name)
    search_and_record(tuner, "" if name == "random" else name + ".")
    if os.environ.get("MATEX_TEST_SEARCH_AGAIN"):
        # the same tuner searches again (after a rank was lost in the first search)
        tuner.oracle.max_trials = int(os.environ["MATEX_TEST_SEARCH_AGAIN"])
        search_and_record(tuner, "again.")
