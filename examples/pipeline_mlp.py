"""Pipeline parallelism: an MLP cut into stages, one stage per rank.

    matexrun -n 2 examples/pipeline_mlp.py            # 2 stages
    matexrun -n 4 examples/pipeline_mlp.py --data 2   # 2 data replicas x 2 stages
    python examples/pipeline_mlp.py                   # 1 process: boundaries are identities

Every rank builds the same model; ``PipelineModel`` keeps this rank's stage,
runs micro-batches through the stages with the 1F1B schedule, and reports
the same, global loss on every rank. At the end the whole model is saved as
one plain Keras file and checked against the pipeline's predictions.
"""

import argparse
import os
import tempfile
import time

import keras
import numpy as np

import matex
import matex.parallel as mp


def build(stages, width=256, depth=8):
    """A ``depth``-layer MLP with a StageBoundary every depth/stages layers."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((64,))]
    for i in range(depth):
        layers.append(keras.layers.Dense(width, activation="relu", name="dense%d" % i))
        if (i + 1) % (depth // stages) == 0 and (i + 1) < depth:
            layers.append(mp.StageBoundary(name="stage%d" % ((i + 1) // (depth // stages))))
    layers.append(keras.layers.Dense(10, name="logits"))
    return keras.Sequential(layers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4096, help="training rows")
    args = parser.parse_args()

    grid = mp.grid(data=args.data, pipeline=matex.size() // args.data)
    stages = grid.pipeline_size
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 64)).astype("float32")
    y = (x[:, :10] @ rng.normal(size=(10, 10)) > 0).argmax(axis=1)

    pm = mp.PipelineModel(build(stages), microbatches=args.microbatches,
                          schedule=args.schedule, grid=grid)
    pm.compile(optimizer=keras.optimizers.Adam(1e-3),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               metrics=["accuracy"])
    mine = pm.stage_bytes()
    sizes = grid.world_comm.allgather(mine)
    if grid.world_rank == 0:
        print("%s: %d stage(s) x %d replica(s); stage parameter bytes per rank: %s"
              % (args.schedule, stages, args.data, sizes))
    start = time.time()
    history = pm.fit(x, y, batch_size=128, epochs=args.epochs, verbose=2)
    if grid.world_rank == 0:
        print("trained in %.1f s; final loss %.4f accuracy %.3f"
              % (time.time() - start, history.history["loss"][-1],
                 history.history["accuracy"][-1]))

    predictions = pm.predict(x[:100], verbose=0)
    path = os.path.join(tempfile.gettempdir(), "pipeline_mlp.keras")
    pm.save(path)   # every stage gathered into one file (rank 0 writes)
    # plain Keras, no MaTEx needed to load it. Every rank loads: under matexrun
    # load_model is collective (rank 0 reads the file and shares it), so a load on
    # rank 0 alone would wait for the others forever.
    whole = keras.models.load_model(path)
    same = np.allclose(whole.predict(x[:100], verbose=0), predictions, atol=1e-5)
    same = all(grid.world_comm.allgather(same))
    if grid.world_rank == 0:
        print("saved %s; reloaded model predicts the same: %s" % (path, same))
    grid.close()


if __name__ == "__main__":
    main()
