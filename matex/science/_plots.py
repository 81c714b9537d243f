"""PNG plots of loss surfaces and Hessian densities (matplotlib, no pyplot state).

Plain local functions: call them on one rank (or on all: the file is
written through a temporary name and a rename, so concurrent writers never
leave a half-written PNG).
"""

from __future__ import annotations

import os

from typing import TYPE_CHECKING, Sequence

import numpy as np

from matex import _atomic

if TYPE_CHECKING:
    from matex.science._hessian import Density

KINDS = ("contour", "3d")


def _save(figure, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    with _atomic.replacing(os.path.abspath(path), mkdir=True) as tmp:
        figure.savefig(tmp, format="png")
    return path


def plot_surface(surface_or_path: np.ndarray | str | os.PathLike, path_png: str,
                 kind: str = "contour", trajectory: np.ndarray | None = None,
                 span: float | tuple = 1.0, levels: int = 30, log: bool = False,
                 title: str | None = None,
                 dpi: int = 80) -> str:
    """Plot a loss surface as a contour map or a 3-D surface; return ``path_png``.

    Args:
      surface_or_path: the array ``loss_surface`` returned (then ``span`` gives
        the axes) or its HDF5 file (axes and trajectory read from it).
      kind: "contour" or "3d".
      trajectory: ``(records, 2)`` coordinates to draw on the contour map
        (default: the file's, when it has one); e.g. ``project_trajectory``.
      log: plot log10 of the loss.
    """
    from matplotlib.figure import Figure

    if kind not in KINDS:
        raise ValueError("kind must be 'contour' or '3d', not %r" % (kind,))
    if isinstance(surface_or_path, (str, os.PathLike)):
        from matex.science._surface import read_surface

        stored = read_surface(os.fspath(surface_or_path))
        loss, x, y = stored["loss"], stored["x"], stored["y"]
        if trajectory is None:
            trajectory = stored["trajectory"]
    else:
        from matex.science._surface import surface_axes

        loss = np.asarray(surface_or_path, np.float64)
        x, y = surface_axes(loss.shape, span)
    values = np.log10(np.maximum(loss, 1e-300)) if log else loss
    label = "log10 loss" if log else "loss"
    gx, gy = np.meshgrid(x, y, indexing="ij")
    figure = Figure(figsize=(5, 4), dpi=dpi)
    if kind == "contour":
        ax = figure.add_subplot()
        finite = np.isfinite(values)
        if finite.sum() >= 4:
            cs = ax.contour(gx, gy, np.ma.masked_invalid(values), levels=levels,
                            cmap="viridis", linewidths=0.8)
            figure.colorbar(cs, ax=ax, label=label)
        if trajectory is not None:
            t = np.asarray(trajectory)
            ax.plot(t[:, 0], t[:, 1], "o-", color="tab:red", markersize=3, linewidth=1,
                    label="training")
            ax.plot(t[-1:, 0], t[-1:, 1], "*", color="black", markersize=9)
            ax.legend(loc="best", fontsize=8)
        ax.set_xlabel("direction 1")
        ax.set_ylabel("direction 2")
    else:
        from mpl_toolkits.mplot3d import Axes3D  # noqa: F401 - registers the projection

        ax = figure.add_subplot(projection="3d")
        ax.plot_surface(gx, gy, np.ma.masked_invalid(values), cmap="viridis",
                        linewidth=0, antialiased=True)
        ax.set_xlabel("direction 1")
        ax.set_ylabel("direction 2")
        ax.set_zlabel(label)
    ax.set_title(title or "loss surface")
    figure.tight_layout()
    return _save(figure, path_png)


def plot_density(density: Density, path_png: str, log: bool = True, title: str | None = None,
                 dpi: int = 80) -> str:
    """Plot a ``hessian_density`` result (density against eigenvalue); return ``path_png``."""
    from matplotlib.figure import Figure

    grid, values = density
    figure = Figure(figsize=(5, 3.5), dpi=dpi)
    ax = figure.add_subplot()
    if log:
        ax.semilogy(grid, np.maximum(values, 1e-12))
    else:
        ax.plot(grid, values)
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density")
    ax.set_title(title or "Hessian spectral density")
    figure.tight_layout()
    return _save(figure, path_png)


def plot_interpolation(alphas: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray,
                       path_png: str, title: str | None = None,
                       dpi: int = 80) -> str:
    """Plot losses along a line between two models (``interpolate``); return ``path_png``."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3.5), dpi=dpi)
    ax = figure.add_subplot()
    ax.plot(alphas, losses, "o-", markersize=3)
    ax.set_xlabel("alpha")
    ax.set_ylabel("loss")
    ax.set_title(title or "linear interpolation")
    figure.tight_layout()
    return _save(figure, path_png)
