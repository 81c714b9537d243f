"""Fault tolerance: a rank is killed in the middle of ``fit``; the others finish the job.

    matexrun --ft --inject-fault "rank=1,step=20,kind=kill" -n 3 examples/fault_tolerance.py
    matexrun --ft -n 3 examples/fault_tolerance.py        # no fault: ends on 3 ranks

``--ft`` launches under ULFM; ``--inject-fault`` makes rank 1 SIGKILL itself
at its 20th training step. The survivors see the failure in a collective,
shrink the communicator, take the new rank 0's weights and optimizer state,
redo the step that failed and share the rest of the epoch among themselves:
no sample is lost or trained twice, the global batch stays the same.
Rank 0 prints the recovery and, at the end (with the defaults, 5 epochs of 4096 rows
in global batches of 128: 5 x 32 = 160 steps)::

    rank(s) [1] lost: 3 -> 2 ranks, recovered in 0.080 s
    finished on 2 of 3 ranks  steps 160  weights equal on every survivor: True  accuracy 0.95

and matexrun exits 0 (the survivors finished cleanly).
"""

import argparse
import os

import numpy as np

import matex
import matex.keras as keras


class ReportRankLoss(keras.callbacks.Callback):
    """MaTEx calls ``on_rank_loss`` on callbacks that define it, after each recovery."""

    def on_rank_loss(self, info):
        if matex.rank() == 0:
            print("rank(s) %s lost: %d -> %d ranks, recovered in %.3f s"
                  % (list(info.lost), info.old_size, info.new_size, info.seconds), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch")
    args = parser.parse_args()
    launched = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 8)).astype("float32")
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype("int64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
              callbacks=[ReportRankLoss()])
    accuracy = model.evaluate(x, y, verbose=0)[1]
    digest = float(sum(np.abs(w).sum() for w in model.get_weights()))
    digests = matex.comm().allgather(digest)         # the survivors' communicator
    if matex.rank() == 0:
        print("finished on %d of %d ranks  steps %d  weights equal on every survivor: %s  "
              "accuracy %.2f" % (matex.size(), launched, int(model.optimizer.iterations),
                                 len(set(digests)) == 1, accuracy), flush=True)


if __name__ == "__main__":
    main()
