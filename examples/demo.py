"""MaTEx demo: train a small CNN data-parallel on MPI ranks.

    matexrun -n 2 examples/demo.py        (what `make demo` runs)

Every rank trains on its own share of a generated dataset; gradients are
averaged with MaTEx's MPI allreduce op, so all ranks hold identical weights.
Only rank 0 prints. Ends with the exact global test accuracy and wall time.
"""

import argparse
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import matex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import CLASSES, make_shapes  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--samples", type=int, default=12000)
    args = parser.parse_args()
    started = time.time()
    rank, size = matex.rank(), matex.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.batch_size % size:
        raise SystemExit("--batch-size %d is not divisible by %d ranks" % (args.batch_size, size))

    x, y = make_shapes(args.samples, seed=1)
    x_test, y_test = make_shapes(2000, seed=2)
    # each rank its own contiguous share; equal share sizes keep step counts equal
    per_rank = len(x) // size
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    say("MaTEx demo: %d ranks, %d training images (%d per rank), classes %s"
        % (size, per_rank * size, per_rank, ", ".join(CLASSES)), flush=True)

    keras.utils.set_random_seed(rank)   # different init per rank: rank 0's wins
    model = keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(len(CLASSES)),
    ])
    model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.Adam(2e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=args.batch_size // size, epochs=args.epochs,
              verbose=2 if rank == 0 else 0)

    # exact global accuracy: each rank scores its share of the test set
    share = slice(rank * len(x_test) // size, (rank + 1) * len(x_test) // size)
    pred = np.argmax(model.predict(x_test[share], verbose=0), axis=1)
    correct = matex.allreduce(tf.constant(int((pred == y_test[share]).sum()), tf.int64), "sum")
    accuracy = int(correct) / len(x_test)
    same = matex.allreduce(tf.constant(float(np.sum([w.sum() for w in model.get_weights()]))),
                           "max") == matex.allreduce(
        tf.constant(float(np.sum([w.sum() for w in model.get_weights()]))), "min")
    say("weights identical on all ranks: %s" % bool(same))
    say("test accuracy: %.4f" % accuracy)
    say("wall time: %.1f s" % (time.time() - started))


if __name__ == "__main__":
    main()
