"""Communicating less: the same training with dense, compressed and local-SGD averaging.

    matexrun -n 2 examples/communicate_less.py
    matexrun -n 2 examples/communicate_less.py --methods dense,topk --epochs 2

Trains one small classifier per method, each from the same start, with
``matex.keras`` (``batch_size`` is the global batch):

* ``dense``: ``DistributedOptimizer`` (every gradient averaged every step);
* ``fp16``: ``compression=FP16``, every gradient sent as 16 bits;
* ``topk``: ``compression=TopK(0.05)``, each rank's largest 5 % of each large
  gradient through the sparse allreduce, with error feedback;
* ``powersgd``: ``compression=PowerSGD(2)``, rank-2 factors of each matrix;
* ``localsgd``: ``LocalSGD(sync_every=4)``, each rank steps alone and the weights
  are averaged every 4 steps.

``matex.stats()`` counts the bytes each rank hands to MPI; rank 0 prints,
per method, the bytes per step against dense, the accuracy, and whether
every rank ended with the same weights::

    dense     bytes/step   9488 (1.00x dense)  accuracy 0.88  weights equal: True
    fp16      bytes/step   4744 (0.50x dense)  accuracy 0.88  weights equal: True
    topk      bytes/step   2548 (0.27x dense)  accuracy 0.88  weights equal: True
    powersgd  bytes/step   2064 (0.22x dense)  accuracy 0.87  weights equal: True
    localsgd  bytes/step   2372 (0.25x dense)  accuracy 0.87  weights equal: True

(``--rows 1024 --epochs 2``; the defaults train longer.)
"""

import argparse

import numpy as np

import matex
import matex.keras as keras
from matex.compression import FP16, PowerSGD, TopK

METHODS = ("dense", "fp16", "topk", "powersgd", "localsgd")


def optimizer(method):
    """The optimizer ``method`` trains with: SGD, wrapped the way that method communicates."""
    sgd = keras.optimizers.SGD(0.05, momentum=0.9)
    if method == "localsgd":
        return matex.LocalSGD(sgd, sync_every=4)
    compression = {"dense": None, "fp16": FP16, "topk": TopK(0.05),
                   "powersgd": PowerSGD(2)}[method]
    return matex.DistributedOptimizer(sgd, compression=compression)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, from: " + ", ".join(METHODS))
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error("unknown method %r (choose from %s)" % (method, ", ".join(METHODS)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 32)).astype("float32")
    y = (x[:, :8] @ rng.normal(size=(8, 4))).argmax(axis=1)
    for method in methods:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=optimizer(method), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = matex.stats()
        model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0)
        after = matex.stats()
        steps = int(model.optimizer.iterations)
        sent = (after["bytes_sent"] - before["bytes_sent"]) / steps
        dense = (after["dense_bytes"] - before["dense_bytes"]) / steps
        accuracy = model.evaluate(x, y, verbose=0)[1]
        digest = float(sum(np.abs(w).sum() for w in model.get_weights()))
        equal = len(set(matex.comm().allgather(digest))) == 1
        if matex.rank() == 0:
            print("%-9s bytes/step %6d (%.2fx dense)  accuracy %.2f  weights equal: %s"
                  % (method, sent, sent / dense, accuracy, equal), flush=True)


if __name__ == "__main__":
    main()
