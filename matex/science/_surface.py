"""Loss surfaces on a 2-D grid, distributed two ways: points to rank groups, data within a group.

The ranks split into groups of ``ranks_per_point`` (``matex._workgroups``:
rank ``r`` is in group ``r // k``). Grid points are handed out dynamically:
world rank 0 serves a queue from a background thread (``matex._workgroups``'s
``Server``, ``Client`` and ``WorkQueue``, each group's state a ``GroupWork``
machine), each group's leader asks it for the next point when the
previous one is done, sending that point's loss along; the leader passes the
point to its group, and the group computes the loss data-parallel (each rank
a contiguous share of the data, one allreduce of (sum, rows) over the group's
communicator slot). A fast group simply takes more points; nothing waits for
the slowest rank until the end.

Rank 0 is the only writer: with ``path`` it writes each loss into the HDF5
file as it arrives and flushes, unfilled points NaN. The file also holds the
axes, both directions and a digest of the centre weights; a rerun with the
same ``path`` and the same settings computes only the points still NaN, one
with different settings is refused. ``max_points`` stops a run after that many
new points (a time-sliced job; also how the tests interrupt one).

Under ULFM (``mpiexec --with-ft ulfm`` / ``matexrun --ft``) with
``ranks_per_point=1``, a rank that dies is noticed by the queue's server
(its probe from any source fails), the point it held goes back in the queue
for the others, and the survivors end on a shrunk communicator (which is
MaTEx's communicator afterwards). Not handled: a failure inside a group of
several ranks (its allreduce fails: the run ends with the error) or of rank
0, the queue's server and writer; a rerun with the same ``path`` resumes.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import tensorflow as tf

from matex import _runtime
from matex._everywhere import on_every_rank
from matex._rank_groups import RankGroup
from matex._workgroups import Client, Groups, Server, WorkQueue
from matex.science import _data, _directions, _objective
from matex.science._trajectory import load_trajectory

if TYPE_CHECKING:
    import keras

PROGRESS_SECONDS = 2.0


def check_resolution(resolution) -> tuple:
    """``(nx, ny)``, each a whole number >= 2 (an int means both)."""
    if isinstance(resolution, int) and not isinstance(resolution, bool):
        resolution = (resolution, resolution)
    try:
        nx, ny = resolution
    except (TypeError, ValueError):
        raise ValueError("resolution must be (nx, ny), not %r" % (resolution,)) from None
    for n in (nx, ny):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError("matex.science: resolution must be at least 2 points per axis "
                             "(whole numbers), not %r" % (resolution,))
    return int(nx), int(ny)


def surface_axes(resolution: int | tuple[int, int], span: float | tuple = 1.0) -> tuple:
    """The grid's coordinates ``(x, y)`` along ``d1`` and ``d2``.

    ``span``: a number s (both axes from -s to s) or ``((x0, x1), (y0, y1))``.
    """
    nx, ny = check_resolution(resolution)
    if isinstance(span, (int, float, np.floating)) and not isinstance(span, bool):
        if not span > 0:
            raise ValueError("span must be > 0, not %r" % (span,))
        (x0, x1), (y0, y1) = (-span, span), (-span, span)
    else:
        try:
            (x0, x1), (y0, y1) = span
        except (TypeError, ValueError):
            raise ValueError("span must be a number or ((x0, x1), (y0, y1)), not %r"
                             % (span,)) from None
    return np.linspace(float(x0), float(x1), nx), np.linspace(float(y0), float(y1), ny)


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, np.float64).tobytes())
    return h.hexdigest()


def _same_everywhere(value, what: str) -> None:
    values = _runtime.control().allgather(value)
    if any(v != values[0] for v in values):
        raise ValueError("matex.science: the %s differ between ranks; pass the same on every "
                         "rank" % what)


def _directions_for(directions, weights, normalization, ignore, seed, trajectory):
    """``(d1, d2, kind, trajectory_coords or None)``; d1, d2 lists of float64 arrays."""
    if normalization not in _directions.NORMALIZATIONS:
        raise ValueError("normalization must be 'filter' or None, not %r" % (normalization,))
    centre = np.concatenate([np.asarray(w, np.float64).reshape(-1) for w in weights])
    shapes = [np.shape(w) for w in weights]
    sizes = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]

    def unflat(v):
        return [p.reshape(s) for p, s in zip(np.split(v, sizes), shapes)]

    coords = None
    if isinstance(directions, str) and directions == "random":
        d1, d2 = _directions.random_directions(weights, seed, normalization, ignore)
        kind = "random"
    elif isinstance(directions, str) and directions == "pca":
        if trajectory is None:
            raise ValueError("matex.science: directions='pca' needs trajectory= (a "
                             "TrajectoryRecorder, its HDF5 file or a (records, parameters) "
                             "array)")
        data = load_trajectory(trajectory)
        if data.ndim != 2 or data.shape[1] != centre.size:
            raise ValueError("matex.science: the trajectory records %s parameters, the model "
                             "has %d trainable parameters" % (data.shape[1:], centre.size))
        v1, v2, _, _ = _directions.pca_directions(data, centre)
        d1, d2, kind = unflat(v1), unflat(v2), "pca"
    elif isinstance(directions, (tuple, list)) and len(directions) == 2 \
            and not isinstance(directions[0], np.ndarray):
        d1 = _directions.check_shapes(directions[0], weights, "directions[0]")
        d2 = _directions.check_shapes(directions[1], weights, "directions[1]")
        if normalization == "filter":
            d1 = _directions.filter_normalize(d1, weights, ignore)
            d2 = _directions.filter_normalize(d2, weights, ignore)
        kind = "given"
    else:
        raise ValueError("directions must be 'random', 'pca' or (d1, d2), two lists of arrays "
                         "shaped like model.trainable_weights")
    if trajectory is not None:
        data = load_trajectory(trajectory)
        if data.ndim == 2 and data.shape[1] == centre.size:
            coords = _directions.project(
                data, [np.concatenate([a.reshape(-1) for a in d]) for d in (d1, d2)], centre)
    return d1, d2, kind, coords


class _Store:
    """The surface on rank 0, and its HDF5 file (the only writer)."""

    def __init__(self, path, x, y, d1, d2, settings, coords):
        self.path = path
        self.values = np.full((x.size, y.size), np.nan)
        self.file = None
        if path is None:
            return
        import h5py

        if os.path.exists(path):
            try:
                f = h5py.File(path, "r+")
            except OSError as exc:
                raise ValueError("matex.science: %s exists and is not an HDF5 file (%s)"
                                 % (path, exc)) from None
            problem = self._differences(f, x, y, d1, d2, settings)
            if problem:
                f.close()
                raise ValueError(
                    "matex.science: %s holds a surface computed with different settings "
                    "(%s); refusing to resume it: use another path or remove the file"
                    % (path, problem))
            self.values = f["loss"][...]
            self.file = f
            return
        f = h5py.File(path, "w")
        f.create_dataset("loss", data=self.values)
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=y)
        for name, d in (("d1", d1), ("d2", d2)):
            g = f.create_group(name)
            for i, a in enumerate(d):
                g.create_dataset(str(i), data=a)
        if coords is not None:
            f.create_dataset("trajectory", data=coords)
        for key, value in settings.items():
            f.attrs[key] = value
        f.flush()
        self.file = f

    @staticmethod
    def _differences(f, x, y, d1, d2, settings) -> str:
        if "loss" not in f or "x" not in f or "y" not in f:
            return "it is not a matex.science surface file"
        if f["loss"].shape != (x.size, y.size):
            return "resolution %s, now %s" % (f["loss"].shape, (x.size, y.size))
        if not (np.array_equal(f["x"][...], x) and np.array_equal(f["y"][...], y)):
            return "grid coordinates (span)"
        for key, value in settings.items():
            stored = f.attrs.get(key)
            if isinstance(stored, bytes):
                stored = stored.decode()
            if stored is None or str(stored) != str(value):
                return "%s: %r, now %r" % (key, stored, value)
        for name, d in (("d1", d1), ("d2", d2)):
            group = f.get(name)
            if group is None or len(group) != len(d) or not all(
                    np.array_equal(group[str(i)][...], a) for i, a in enumerate(d)):
                return "direction %s" % name
        return ""

    def put(self, index: int, loss: float) -> None:
        i, j = np.unravel_index(index, self.values.shape)
        self.values[i, j] = loss
        if self.file is not None:
            self.file["loss"][i, j] = loss
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


class _Queue(WorkQueue):
    """The points still to compute, handed out to groups on request (thread-safe).

    Each loss is written to the store as it arrives (rank 0 is the only writer).
    """

    def __init__(self, store, groups: int, max_points, verbose):
        super().__init__(np.flatnonzero(np.isnan(store.values.reshape(-1))).tolist(), groups,
                         max_points)
        self.store, self.verbose = store, verbose
        self.total = store.values.size
        self.done = 0
        self.start = self.last_report = time.monotonic()

    def record(self, result):
        self.store.put(*result)
        self.done += 1
        self._report()

    def finishing(self, last):
        self._report(final=last)

    def ranks_lost(self, service_ranks, k):
        """Under ULFM: the groups of failed ranks are done; their points go back in the queue."""
        for group in self.lose({r // k for r in service_ranks}):
            print("matex.science: rank group %d lost; its point goes to another group"
                  % group, file=sys.stdout, flush=True)

    def _report(self, final=False):
        now = time.monotonic()
        if not self.verbose or (not final and now - self.last_report < PROGRESS_SECONDS):
            return
        self.last_report = now
        filled = int(np.count_nonzero(~np.isnan(self.store.values)))
        rate = self.done / max(now - self.start, 1e-9)
        print("matex.science: loss surface %d/%d points (%d this run), %.2f points/s"
              % (filled, self.total, self.done, rate), file=sys.stdout, flush=True)


def loss_surface(model: keras.Model, data: Any,
                 directions: str | tuple[Sequence[np.ndarray], Sequence[np.ndarray]] = "random",
                 resolution: int | tuple[int, int] = (51, 51), span: float | tuple = 1.0,
                 normalization: str | None = "filter", path: str | None = None, *,
                 ignore: str | None = "biasbn", seed: int = 0, trajectory: Any = None,
                 ranks_per_point: int = 1,
                 batch_size: int = 256, max_points: int | None = None,
                 verbose: int = 1) -> np.ndarray:
    """The compiled loss on a grid around the model's weights (collective over all ranks).

    Point ``(i, j)`` is the loss over all of ``data`` at ``w + x[i]*d1 + y[j]*d2``
    (``x, y = surface_axes(resolution, span)``); with an odd resolution and a
    symmetric span the centre is ``model.evaluate``'s loss. The model's weights
    are put back afterwards.

    Args:
      model: a compiled Keras model.
      data: ``(x, y[, sample_weight])`` arrays (the global data set, the same on
        every rank) or a ``tf.data.Dataset`` of global batches; a dataset that
        already holds this rank's share needs ``ranks_per_point`` = all ranks.
      directions: "random" (Gaussian, from ``seed``), "pca" (of ``trajectory``,
        not normalised: unit vectors) or ``(d1, d2)``, lists of arrays shaped
        like ``model.trainable_weights``.
      resolution: ``(nx, ny)``, at least 2 each.
      span: s (both axes in [-s, s]) or ``((x0, x1), (y0, y1))``.
      normalization: "filter" (Li et al. 2018, see ``_directions``) or None;
        applies to random and given directions.
      path: HDF5 file written as points finish; rerunning resumes it. One that
        cannot be opened or created, or holds another surface, is a ValueError on
        every rank.
      ignore: "biasbn" (1-D weights get zero directions) or None (their own values).
      trajectory: a ``TrajectoryRecorder``, its file or a ``(records, parameters)``
        array; needed for "pca", and stored projected on the directions (plots).
      ranks_per_point: ranks computing one point together (divides the ranks).
      batch_size: rows per forward pass on one rank.
      max_points: compute at most this many new points in this call (others stay NaN).
      verbose: progress lines on rank 0 (points done / total, points/s).
    Returns:
      ``(nx, ny)`` float64 array of losses, the same on every rank; NaN where
      not computed (``max_points``).
    """
    _objective.check_model(model)
    x_axis, y_axis = surface_axes(resolution, span)
    if max_points is not None and (isinstance(max_points, bool)
                                   or not isinstance(max_points, int) or max_points < 0):
        raise ValueError("max_points must be a whole number >= 0 or None, not %r"
                         % (max_points,))
    world = _runtime.comm()
    size = world.Get_size()
    k = ranks_per_point
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or size % k:
        raise ValueError(
            "matex.science: ranks_per_point (%r) must be a whole number that divides the "
            "number of ranks (%d): one of %s" % (
                k, size, ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)))
    weights = [v.numpy() for v in model.trainable_weights]
    d1, d2, kind, coords = _directions_for(directions, weights, normalization, ignore, seed,
                                           trajectory)
    _same_everywhere(_digest(d1 + d2), "directions")
    _same_everywhere(_digest(weights), "model weights")
    settings = {"kind": kind, "normalization": str(normalization), "ignore": str(ignore),
                "centre_sha256": _digest(weights)}
    if isinstance(data, (tuple, list)):
        settings["rows"] = int(np.shape(tf.nest.flatten(data[0])[0])[0])

    # group g holds world ranks g*k .. g*k+k-1 (matex._workgroups); bad data fails here, early
    share = _data.Share(data, world.Get_rank() % k, k, batch_size, whole_job=(k == size))

    # rank 0 opens (or resumes) the file; any error there (another surface's file, a
    # path that cannot be created) is a ValueError on every rank
    store = on_every_rank(
        _runtime.control(),
        lambda: _Store(path, x_axis, y_axis, d1, d2, settings, coords)
        if world.Get_rank() == 0 else None,
        error_type=ValueError, what="matex.science: loss_surface: %s" % (path,))

    groups = Groups(k, world)
    ranks = RankGroup(world, groups.index, groups.world_rank)
    group = ranks.comm
    group_ctl = group.Dup()
    objective = _objective.Objective(model, share, comm=ranks.slot)
    queue = server = None
    try:
        if world.Get_rank() == 0:
            queue = _Queue(store, groups.count, max_points, verbose)
            server = Server(groups.service, queue,
                            on_failure=lambda failed: queue.ranks_lost(failed, k)).start()
        client = Client(groups, queue)
        leader = group.Get_rank() == 0
        result = None
        while True:
            task = None
            if leader:
                task = client("next", groups.index, result)
                while task == "wait":
                    time.sleep(0.02)
                    task = client("next", groups.index, None)
            task = group_ctl.bcast(task, root=0)
            if task is None:
                break
            if isinstance(task, tuple):
                raise RuntimeError("matex.science: another rank group failed: %s" % task[1])
            i, j = np.unravel_index(task, (x_axis.size, y_axis.size))
            objective.set([w + x_axis[i] * a + y_axis[j] * b
                           for w, a, b in zip(weights, d1, d2)])
            try:
                loss = objective.loss()
            except Exception as exc:
                if leader:
                    client("fail", groups.index, "%s: %s" % (type(exc).__name__, exc))
                raise
            result = (int(task), loss)
        if queue is not None:
            while queue.settled() < groups.count:
                time.sleep(0.002)
            store.close()   # before any rank can read the file
        if _runtime.ft_mode() == "ulfm":
            # the job without the ranks lost meanwhile (if any): MaTEx's communicator from now
            if server is not None:
                server.stop()
                server = None
            _runtime._set_comm(world.Shrink())
        surface = _runtime.control().bcast(queue.store.values if queue else None, root=0)
    except BaseException as exc:
        if queue is not None:
            # rank 0 serves the queue: tell every other group before its server goes, or
            # their leaders would wait for a next point forever
            queue.stop(groups.index, "rank 0 failed: %s: %s" % (type(exc).__name__, exc))
            deadline = time.monotonic() + 300
            while queue.settled() < groups.count and time.monotonic() < deadline:
                time.sleep(0.01)
        raise
    finally:
        if server is not None:
            server.stop()
        if store is not None:
            store.close()
        objective.set(weights)
        ranks.release()
        for c in (group_ctl, groups.service):
            c.Free()
    return surface


def read_surface(path: str) -> dict:
    """A surface file: ``loss``, ``x``, ``y``, ``d1``, ``d2``, ``trajectory`` and settings."""
    import h5py

    with h5py.File(path, "r") as f:
        out = {"loss": f["loss"][...], "x": f["x"][...], "y": f["y"][...],
               "d1": [f["d1"][str(i)][...] for i in range(len(f["d1"]))],
               "d2": [f["d2"][str(i)][...] for i in range(len(f["d2"]))],
               "trajectory": f["trajectory"][...] if "trajectory" in f else None}
        out.update({k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()})
    return out
