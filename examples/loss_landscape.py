"""Loss landscape and Hessian spectrum of a small CNN on the shapes data set (matex.science).

Trains a CNN on ``examples/shapes.py`` images while a ``TrajectoryRecorder``
keeps the weights after every epoch, then, on every rank together:

* the loss surface around the final weights in the plane of the trajectory's
  two principal directions, with the trajectory drawn on it (contour map),
  and a filter-normalised random-direction surface (3-D);
* the top Hessian eigenvalues, the trace (Hutchinson) and the spectral
  density (stochastic Lanczos quadrature), and the trajectory's coordinates
  along the two top eigenvectors.

    mpiexec -n 2 python examples/loss_landscape.py --out docs
    mpiexec -n 2 python examples/loss_landscape.py --quick --out /tmp/landscape
"""

import argparse
import os
import sys
import time

import numpy as np

import matex
import matex.keras as keras
import matex.science as science

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import make_shapes  # noqa: E402


def say(*parts):
    if matex.rank() == 0:
        print(*parts, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder for the PNG and HDF5 files")
    parser.add_argument("--quick", action="store_true", help="small grid, few epochs")
    parser.add_argument("--resolution", type=int, default=None)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    n = args.resolution or (9 if args.quick else 21)

    x, y = make_shapes(1200, seed=0)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(4, name="classifier"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    recorder = science.TrajectoryRecorder()
    epochs = 4 if args.quick else 12
    model.fit(x, y, epochs=epochs, batch_size=64, verbose=0, callbacks=[recorder])
    loss, accuracy = model.evaluate(x, y, verbose=0)
    say("trained %d epochs on %d ranks: loss %.4f, accuracy %.3f"
        % (epochs, matex.size(), loss, accuracy))

    # surface in the trajectory's PCA plane, spanning the path with a margin
    from matex.science._directions import pca_directions

    _, _, coords, explained = pca_directions(recorder.weights.astype(np.float64))
    lo, hi = coords.min(0), coords.max(0)
    pad = 0.25 * (hi - lo)
    span = ((lo[0] - pad[0], hi[0] + pad[0]), (lo[1] - pad[1], hi[1] + pad[1]))
    path = os.path.join(args.out, "loss_surface.h5")
    start = time.perf_counter()
    surface = science.loss_surface(model, (x, y), directions="pca", trajectory=recorder,
                                   resolution=(n, n), span=span, path=path, batch_size=400)
    say("PCA surface %dx%d in %.1f s (%.2f points/s); PCA explains %.0f%% + %.0f%%"
        % (n, n, time.perf_counter() - start, n * n / (time.perf_counter() - start),
           100 * explained[0], 100 * explained[1]))
    say("surface min %.4f, centre (final weights) %.4f" % (np.nanmin(surface), loss))
    random_path = os.path.join(args.out, "loss_surface_random.h5")
    science.loss_surface(model, (x, y), directions="random", resolution=(n, n), span=1.0,
                         path=random_path, batch_size=400)
    if matex.rank() == 0:
        science.plot_surface(path, os.path.join(args.out, "loss_surface.png"),
                             title="shapes CNN: loss in the PCA plane of training")
        science.plot_surface(random_path, os.path.join(args.out, "loss_surface_3d.png"),
                             kind="3d", title="shapes CNN: filter-normalised random plane")

    start = time.perf_counter()
    top, vectors = science.hessian_eigenvalues(model, (x, y), top_k=4, return_vectors=True,
                                               batch_size=400, verbose=1)
    say("top Hessian eigenvalues %s (%.1f s)" % (np.round(top, 4), time.perf_counter() - start))
    trace = science.hessian_trace(model, (x, y), n_samples=10 if args.quick else 30,
                                  batch_size=400)
    say("Hessian trace (Hutchinson) %.4f" % trace)
    density = science.hessian_density(model, (x, y), n_vectors=3 if args.quick else 4,
                                      n_steps=20 if args.quick else 50, batch_size=400,
                                      verbose=1)
    say("SLQ: density integrates to %.4f; mean eigenvalue %.5f, trace/parameters %.5f"
        % (np.trapezoid(density.density, density.grid),
           np.sum(density.nodes * density.weights) / density.nodes.shape[0],
           trace / sum(int(np.prod(v.shape)) for v in model.trainable_weights)))
    along = science.project_trajectory(recorder, vectors[:2])
    say("trajectory along the top two eigenvectors:\n%s" % np.round(along, 3))
    if matex.rank() == 0:
        science.plot_density(density, os.path.join(args.out, "hessian_density.png"),
                             title="shapes CNN: Hessian spectral density (SLQ)")


if __name__ == "__main__":
    main()
