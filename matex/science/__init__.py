"""Looking at training: loss landscapes and Hessian spectra, distributed over MPI.

    import matex.science as science
    surface = science.loss_surface(model, (x, y), resolution=(25, 25), path="s.h5")
    science.plot_surface("s.h5", "surface.png", kind="contour")
    top = science.hessian_eigenvalues(model, (x, y), top_k=5)

Every function that computes a loss is collective: call it on every rank with
the same arguments. Arrays are the global data set (sharded as ``fit``
shards it); a dataset from ``matex.readers`` is this rank's share already.
"""

from matex.science import _requires  # noqa: F401 - first: names the extra if scipy/matplotlib lack
from matex.science._apoptosis import NeuronApoptosis, count_shrunk_params, shrink_model
from matex.science._directions import filter_normalize
from matex.science._hessian import Density, hessian_density, hessian_eigenvalues, hessian_trace
from matex.science._interpolate import interpolate
from matex.science._plots import plot_density, plot_interpolation, plot_surface
from matex.science._pruning import SamplePruning
from matex.science._recipes import recipe
from matex.science._surface import loss_surface, read_surface, surface_axes
from matex.science._trajectory import TrajectoryRecorder, load_trajectory, project_trajectory

__all__ = [
    "loss_surface",
    "read_surface",
    "surface_axes",
    "filter_normalize",
    "interpolate",
    "TrajectoryRecorder",
    "load_trajectory",
    "project_trajectory",
    "hessian_eigenvalues",
    "hessian_density",
    "hessian_trace",
    "Density",
    "plot_surface",
    "plot_density",
    "plot_interpolation",
    "NeuronApoptosis",
    "shrink_model",
    "count_shrunk_params",
    "SamplePruning",
    "recipe",
]
