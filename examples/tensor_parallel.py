"""Tensor (horizontal) model parallelism: one wide MLP whose layers are split over the ranks.

    matexrun -n 2 examples/tensor_parallel.py                 # the 2 ranks split every layer
    matexrun -n 4 examples/tensor_parallel.py --tensor 2      # 2 data replicas x 2-way split

``ColumnParallelDense`` keeps 1/T of a layer's output features on each rank,
``RowParallelDense`` 1/T of its input features and sums the partial outputs
(one allreduce forward, one backward): every rank of a tensor group sees the
same batch, holds 1/T of the weights and gets the whole model's output.
Seeded initializers make the shards, put together, exactly the weights of
the unsharded model, so the run also trains the plain Keras model the split
one stands for and compares them. At the end ``mp.save_model`` gathers the
shards into an ordinary Keras file. Rank 0 prints::

    tensor 2 x data 1: each rank holds 0.50 of the parameters
    accuracy 0.95; equals the unsharded Keras model: True
    saved tensor_parallel.keras (plain Dense layers); reloaded model predicts the same: True
"""

import argparse
import os
import tempfile

import keras
import numpy as np

import matex
import matex.parallel as mp


def build(width, split, classes=4):
    """The MLP; ``split`` True: its two Dense layers split over the grid's tensor ranks."""
    def seeded(seed):
        return {"kernel_initializer": keras.initializers.GlorotUniform(seed=seed)}

    if split:
        hidden = mp.ColumnParallelDense(width, "relu", gather_output=False, **seeded(1))
        out = mp.RowParallelDense(classes, **seeded(2))
    else:
        hidden = keras.layers.Dense(width, "relu", **seeded(1))
        out = keras.layers.Dense(classes, **seeded(2))
    return keras.Sequential([keras.Input((32,)), hidden, out])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor", type=int, default=None, help="ranks per layer (default: all)")
    parser.add_argument("--width", type=int, default=1024, help="hidden units (split T ways)")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    tensor = args.tensor or matex.size()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 32)).astype("float32")
    y = (x[:, :8] @ rng.normal(size=(8, 4))).argmax(axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batch = 64

    with mp.grid(tensor=tensor) as g:
        model = build(args.width, split=True)
        model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                      loss=loss, metrics=["accuracy"])
        reference = build(args.width, split=False)        # what the split model stands for
        reference.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        fraction = mp.parameter_bytes(model) / mp.parameter_bytes(reference)
        # each data replica trains on its slice of every global batch of 64 rows
        per = batch // g.data_size
        mine = np.concatenate([np.arange(b + g.data_rank * per, min(b + (g.data_rank + 1) * per,
                                                                    args.rows))
                               for b in range(0, args.rows, batch)])
        model.fit(x[mine], y[mine], batch_size=per, epochs=args.epochs, shuffle=False,
                  verbose=0)
        reference.fit(x, y, batch_size=batch, epochs=args.epochs, shuffle=False, verbose=0)
        predictions = model.predict(x[:256], verbose=0)
        accuracy = float(np.mean(predictions.argmax(1) == y[:256]))
        equal = np.allclose(predictions, reference.predict(x[:256], verbose=0),
                            rtol=1e-3, atol=1e-4)
        equal = all(g.world_comm.allgather(bool(equal)))

        path = os.path.join(tempfile.gettempdir(), "tensor_parallel.keras")
        mp.save_model(model, path)        # collective; world rank 0 of the grid writes
        # plain Keras reads it; every rank loads (under matexrun load_model is collective)
        plain = keras.models.load_model(path)
        kinds = sorted({type(layer).__name__ for layer in plain.layers})
        same = np.allclose(plain.predict(x[:256], verbose=0), predictions, rtol=1e-4, atol=1e-5)
        same = all(g.world_comm.allgather(bool(same)))
        if g.world_rank == 0:
            print("tensor %d x data %d: each rank holds %.2f of the parameters"
                  % (g.tensor_size, g.data_size, fraction))
            print("accuracy %.2f; equals the unsharded Keras model: %s" % (accuracy, equal))
            print("saved %s (plain %s layers); reloaded model predicts the same: %s"
                  % (os.path.basename(path), "/".join(kinds), same), flush=True)


if __name__ == "__main__":
    main()
