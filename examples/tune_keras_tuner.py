"""An ordinary Keras Tuner script: nothing in it knows about MaTEx or MPI.

    matexrun -n 4 --ranks-per-trial 2 examples/tune_keras_tuner.py
    MATEX_RANKS_PER_TRIAL=2 mpiexec -n 4 python -m matex examples/tune_keras_tuner.py
    python examples/tune_keras_tuner.py          # one process, plain Keras Tuner

Under MaTEx the 4 ranks form 2 groups of 2: each group trains its own trials,
every trial a data-parallel fit over its 2 ranks (global batch 64); rank 0
owns the oracle and the tuner directory. Prints the best hyperparameters and
the best model's validation accuracy (every rank of the best trial's group
agrees; rank 0 prints). ``--trials N --epochs E`` make it shorter.
"""

import argparse

import keras
import keras_tuner as kt
import numpy as np


def build(hp):
    model = keras.Sequential([keras.Input((8,))])
    for i in range(hp.Int("layers", 1, 3)):
        model.add(keras.layers.Dense(hp.Int("units_%d" % i, 8, 64, step=8), activation="relu"))
    model.add(keras.layers.Dense(1, activation="sigmoid"))
    model.compile(optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-3, 3e-2, sampling="log")),
                  loss="binary_crossentropy", metrics=["accuracy"])
    return model


parser = argparse.ArgumentParser(description="a Keras Tuner random search")
parser.add_argument("--trials", type=int, default=8)
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 8)).astype("float32")
y = ((x[:, 0] * x[:, 1] + np.sin(x[:, 2])) > 0).astype("float32")

tuner = kt.RandomSearch(build, objective="val_accuracy", max_trials=args.trials, seed=0,
                        directory="tune-example", project_name="random", overwrite=True)
tuner.search(x, y, validation_split=0.25, epochs=args.epochs, batch_size=64, verbose=0)
best = tuner.get_best_hyperparameters()[0]
print("best hyperparameters:", best.values)
model = tuner.get_best_models(1)[0]
print("its validation accuracy: %.3f" % model.evaluate(x[-512:], y[-512:], verbose=0)[1])
