"""The communicator grid: data x pipeline x tensor-parallel groups of ranks.

``grid(data=D, pipeline=P, tensor=T)`` splits the current communicator
(``matex.comm()``, of size D*P*T) in three ways. Rank order: tensor-parallel
groups are consecutive ranks (innermost, they exchange the most), then
pipeline stages, then data-parallel replicas (outermost):

    world_rank = (data_rank * P + pipeline_rank) * T + tensor_rank

While the grid is open, the *data* communicator (the ranks that hold the same
pipeline stage and tensor shard) is installed as MaTEx's communicator, slot
0: ``matex.comm()``, ``rank()``, ``size()``, every default collective, the
gradient averaging of ``DistributedOptimizer``, ``fit``'s data sharding and
exact metrics all work over the data dimension, unchanged. The pipeline and
tensor communicators get slots of their own (``pipeline_slot``,
``tensor_slot``) for the ops' ``comm`` argument, and so does a duplicate of
the communicator the grid was cut from (``world_slot``). ``Grid.close()``
(or leaving ``with grid(...)``) frees them and reinstalls that communicator.
One grid at a time.
"""

from __future__ import annotations

from typing import Optional

from mpi4py import MPI

from matex import _resilience, _runtime, _state
from matex._rank_groups import RankGroup, cut

_now = _state.namespace("parallel.grid", active=None)   # the open grid


class Grid:
    """This rank's place in a D x P x T grid and its three sub-communicators.

    Attributes: ``data_size``, ``pipeline_size``, ``tensor_size``; this rank's
    ``data_rank``, ``pipeline_rank``, ``tensor_rank`` and ``world_rank``;
    mpi4py communicators ``data_comm``, ``pipeline_comm``, ``tensor_comm``,
    ``world_comm``; the slots the ops name them by: ``data_slot`` (0),
    ``pipeline_slot``, ``tensor_slot``, ``world_slot``.
    """

    def __init__(self, world: MPI.Intracomm, data: int, pipeline: int, tensor: int) -> None:
        self.data_size, self.pipeline_size, self.tensor_size = data, pipeline, tensor
        self.world_size = world.Get_size()
        self.world_rank = w = world.Get_rank()
        self.tensor_rank = w % tensor
        self.pipeline_rank = (w // tensor) % pipeline
        self.data_rank = w // (tensor * pipeline)
        d, p, t = self.data_rank, self.pipeline_rank, self.tensor_rank
        # A duplicate survives the replacement of the communicator it copies
        # (``_set_comm`` frees the one MaTEx owned).
        self._world = RankGroup.adopt(world.Dup())
        self.data_comm = cut(world, p * tensor + t, d)
        self._pipeline = RankGroup(world, d * tensor + t, p)
        self._tensor = RankGroup(world, d * pipeline + p, t)
        self.world_comm, self.pipeline_comm, self.tensor_comm = (
            g.comm for g in (self._world, self._pipeline, self._tensor))
        self.data_slot = 0
        self.pipeline_slot, self.tensor_slot, self.world_slot = (
            g.slot for g in (self._pipeline, self._tensor, self._world))
        _runtime._set_comm(self.data_comm)   # MaTEx now owns (and will free) it
        self._closed = False
        if pipeline * tensor > 1:   # a lost rank's weights exist nowhere else
            _resilience.add_recovery_veto(self._refuse_recovery)

    def world_rank_of(self, data: Optional[int] = None, pipeline: Optional[int] = None,
                      tensor: Optional[int] = None) -> int:
        """World rank at the given coordinates (an omitted one: this rank's)."""
        d = self.data_rank if data is None else data
        p = self.pipeline_rank if pipeline is None else pipeline
        t = self.tensor_rank if tensor is None else tensor
        for name, v, n in (("data", d, self.data_size), ("pipeline", p, self.pipeline_size),
                           ("tensor", t, self.tensor_size)):
            if not 0 <= v < n:
                raise ValueError("%s coordinate %d is outside [0, %d)" % (name, v, n))
        return (d * self.pipeline_size + p) * self.tensor_size + t

    def coordinates_of(self, world_rank: int) -> tuple[int, int, int]:
        """(data, pipeline, tensor) coordinates of ``world_rank``."""
        if not 0 <= world_rank < self.world_size:
            raise ValueError("rank %d is outside [0, %d)" % (world_rank, self.world_size))
        t = world_rank % self.tensor_size
        p = (world_rank // self.tensor_size) % self.pipeline_size
        return world_rank // (self.tensor_size * self.pipeline_size), p, t

    @property
    def shape(self) -> tuple[int, int, int]:
        """(data_size, pipeline_size, tensor_size)."""
        return self.data_size, self.pipeline_size, self.tensor_size

    def close(self) -> None:
        """Reinstall the communicator the grid was cut from and free the sub-communicators.

        Collective over the grid's ranks. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        _resilience.remove_recovery_veto(self._refuse_recovery)
        for group in (self._pipeline, self._tensor):
            group.release()
        # the world communicator is in use again (the runtime frees it when replaced)
        _runtime._set_comm(self._world.detach())   # frees the data communicator
        if _now.active is self:
            _now.active = None

    def _refuse_recovery(self):
        """MaTEx's recovery (shrink the data communicator, go on) cannot rebuild a
        model-parallel grid: end the run with ``RankFailure`` naming the lost ranks."""
        from matex.errors import RankFailure

        lost = revoke_and_find_lost([self.pipeline_comm, self.tensor_comm, _runtime.comm()],
                                    self.world_comm)
        raise RankFailure(
            "matex.parallel: rank(s) %s of this %d x %d x %d grid failed; a pipeline- or "
            "tensor-parallel run cannot recover from a rank failure (a lost rank's weights "
            "exist nowhere else), so the job ends. Restart it from a checkpoint."
            % (", ".join(map(str, lost)) if lost else "?", self.data_size, self.pipeline_size,
               self.tensor_size), lost)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return ("Grid(data=%d, pipeline=%d, tensor=%d; this rank %d at (%d, %d, %d))"
                % (self.data_size, self.pipeline_size, self.tensor_size, self.world_rank,
                   self.data_rank, self.pipeline_rank, self.tensor_rank))


def revoke_and_find_lost(comms, world) -> list:
    """Revoke ``comms`` and ``world`` (every rank still blocked in one of them fails
    instead of hanging) and return the failed ranks of ``world`` (ULFM; else [])."""
    if _resilience.mode() != "ulfm":
        return []
    for c in list(comms) + [world, _runtime.control()]:
        try:
            c.Revoke()
        except MPI.Exception:
            pass   # already revoked, or freed
    try:
        world.Ack_failed()
        group = world.Get_failed()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                          world.Get_group())
        return sorted(r for r in ranks if r >= 0)
    except MPI.Exception:
        return []


def grid(data: Optional[int] = None, pipeline: int = 1, tensor: int = 1) -> Grid:
    """Split ``matex.comm()`` into a ``data`` x ``pipeline`` x ``tensor`` grid (collective).

    ``data`` defaults to size / (pipeline * tensor). Raises ValueError on
    every rank when the sizes are not positive integers or their product is
    not the number of ranks, RuntimeError when a grid is already open.
    """
    world = _runtime.comm()
    size = world.Get_size()
    for name, v in (("pipeline", pipeline), ("tensor", tensor)) + (
            (("data", data),) if data is not None else ()):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError("grid: %s must be a positive integer, not %r" % (name, v))
    if data is None:
        if size % (pipeline * tensor):
            raise ValueError(
                "grid: pipeline x tensor = %d x %d = %d does not divide the %d ranks of "
                "the communicator" % (pipeline, tensor, pipeline * tensor, size))
        data = size // (pipeline * tensor)
    if data * pipeline * tensor != size:
        raise ValueError(
            "grid: data x pipeline x tensor = %d x %d x %d = %d, but the communicator "
            "has %d ranks; the product must equal the number of ranks"
            % (data, pipeline, tensor, data * pipeline * tensor, size))
    if _now.active is not None:
        raise RuntimeError("grid: a grid is already open (%r); close() it first" % _now.active)
    _now.active = Grid(world, data, pipeline, tensor)
    return _now.active


def current() -> Optional[Grid]:
    """The open grid, or None."""
    return _now.active
