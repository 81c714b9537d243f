"""Cost of ``hvd.elastic`` commits in memory and written through for ``matexrun --elastic``.

Usage: python benchmarks/elastic_commit.py [--units N] [--commits N]   (or under mpiexec)

A ``KerasState`` of a model of two ``Dense(units)`` layers with Adam (its slots
built) is committed inside ``hvd.elastic.run``: first with no
``MATEX_CHECKPOINT_DIR`` (the commit is the host-memory copy), then with one
(rank 0 also pickles the commit to a file and renames it into place, as under
``matexrun --elastic``). Prints ms per commit (best of 3 rounds), the state's
size and the ratio written-through / in memory, on rank 0.
"""

import argparse
import os
import tempfile
import time

import keras
import numpy as np

import matex.horovod.tensorflow.keras as hvd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--commits", type=int, default=10)
    args = parser.parse_args()
    hvd.init()
    model = keras.Sequential([keras.Input((args.units,)), keras.layers.Dense(args.units),
                              keras.layers.Dense(args.units)])
    optimizer = keras.optimizers.Adam()
    state = hvd.elastic.KerasState(model, optimizer, batch=0)
    megabytes = sum(np.asarray(v).nbytes for v in model.weights + optimizer.variables) / 1e6

    def bench(state):
        for _ in range(2):   # warm-up
            state.commit()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(args.commits):
                state.commit()
            times.append((time.perf_counter() - start) / args.commits * 1e3)
        return min(times)

    os.environ.pop("MATEX_CHECKPOINT_DIR", None)
    in_memory = hvd.elastic.run(bench)(state)
    with tempfile.TemporaryDirectory() as directory:
        os.environ["MATEX_CHECKPOINT_DIR"] = directory
        written = hvd.elastic.run(bench)(state)
    if hvd.rank() == 0:
        print("ranks %d, %.1f MB of state: commit %.1f ms in memory, %.1f ms written through "
              "(%.1fx, %.1f ms per MB written)"
              % (hvd.size(), megabytes, in_memory, written, written / in_memory,
                 (written - in_memory) / megabytes))


if __name__ == "__main__":
    main()
