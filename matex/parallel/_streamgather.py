"""Weights handed to one rank whole, one at a time (``gather_model``, streamed saving).

Tensor- and pipeline-parallel models hold their weights in pieces across
ranks. ``stream_gather`` hands them to ``root`` one weight at a time, so root
never holds more than one weight beyond its own (``_tensor.gather_model``,
``_pipeline``'s ``gather_model``, ``_streamsave.save_streamed``).
"""

from __future__ import annotations

import numpy as np

from matex._everywhere import on_every_rank

_STREAM_TAG = 0x5e17


def stream_gather(comm, root: int, offers, sink, what: str, part_sink=None) -> None:
    """Hand ``root`` every weight, whole, one at a time: ``sink(key, array)`` there.

    Collective over the mpi4py ``comm``. ``offers``: this rank's
    ``(key, part, parts, axis, value)`` (``weight_offers``); several ranks may
    offer the same piece (data replicas): the lowest rank gives it. Root agrees a
    plan (which rank sends which piece, in key order), then receives the pieces
    of one weight, concatenates them along ``axis`` and hands the whole to
    ``sink`` before the next: its peak is one weight, and no rank but root ever
    holds more than its own pieces (today's allgather of whole layers to every
    tensor rank and pickled gather of every stage are gone). Shared by
    ``gather_model`` and ``PipelineModel.gather_model``. An error anywhere (a
    missing piece, ``sink`` on root) is raised on every rank, after the
    transfers (no rank is left waiting). With ``part_sink``, root never joins
    the pieces: ``part_sink(key, axis, offset, piece)`` takes each as it
    arrives (``offset`` along ``axis``; axis None for a whole weight), so root's
    peak is one piece (``save_model`` writes it straight into the file).
    """
    me = comm.Get_rank()
    mine = {(key, part): value for key, part, _, _, value in offers}
    meta = [(key, part, parts, axis) for key, part, parts, axis, _ in offers]

    def make_plan():
        everyone = comm.gather(meta, root=root)
        if me != root:
            return None
        plan, shape = {}, {}
        for rank, items in enumerate(everyone):
            for key, part, parts, axis in items:
                if shape.setdefault(key, (parts, axis)) != (parts, axis):
                    raise ValueError("%s: %s is split %s on one rank, %s on another"
                                     % (what, key, shape[key], (parts, axis)))
                plan.setdefault(key, {}).setdefault(part, rank)
        steps = []
        for key in sorted(plan):
            parts, axis = shape[key]
            if sorted(plan[key]) != list(range(parts)):
                raise ValueError("%s: no rank holds part(s) %s of %s" % (
                    what, sorted(set(range(parts)) - set(plan[key])), key))
            steps.append((key, [plan[key][p] for p in range(parts)], axis))
        return steps

    plan = comm.bcast(on_every_rank(comm, make_plan, error_type=ValueError, what=what),
                      root=root)
    failure = []

    def piece(key, part):
        try:
            return mine[(key, part)]()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure.append(exc)
            return None

    def send(value):
        # a small header, then the array's own buffer (no pickled copy of it)
        value = None if value is None else np.ascontiguousarray(value)
        comm.send(None if value is None else (value.shape, value.dtype), dest=root,
                  tag=_STREAM_TAG)
        if value is not None:       # as bytes: any dtype (bfloat16 too)
            comm.Send(value.reshape(-1).view(np.uint8), dest=root, tag=_STREAM_TAG)

    def receive(rank):
        header = comm.recv(source=rank, tag=_STREAM_TAG)
        if header is None:
            return None
        value = np.empty(header[0], header[1])
        comm.Recv(value.reshape(-1).view(np.uint8), source=rank, tag=_STREAM_TAG)
        return value

    for key, ranks, axis in plan:
        for part, rank in enumerate(ranks):
            if rank == me and me != root:
                send(piece(key, part))
        if me != root:
            continue
        if part_sink is not None:
            offset = 0
            for part, rank in enumerate(ranks):
                value = piece(key, part) if rank == me else receive(rank)
                if failure or value is None:
                    continue             # keep receiving: the senders must not wait
                try:
                    part_sink(key, axis, offset, value)
                except Exception as exc:  # noqa: BLE001 - raised on every rank below
                    failure.append(exc)
                if axis is not None:
                    offset += value.shape[axis]
                del value
            continue
        pieces = [piece(key, part) if rank == me else receive(rank)
                  for part, rank in enumerate(ranks)]
        if failure or any(p is None for p in pieces):
            continue                     # keep receiving: the senders must not wait
        try:
            sink(key, pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure.append(exc)
        del pieces

    def report():
        if failure:
            raise failure[0]
    on_every_rank(comm, report, error_type=ValueError, what=what)
