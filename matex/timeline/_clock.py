"""Aligning the ranks' clocks at the timeline's start, against rank 0.

Ranks on rank 0's machine read the very clock rank 0 reads (``time.time()``
is the kernel's realtime clock, one per machine, containers included): their
offset is exactly 0 and is not measured. Measuring it would only add error:
a ping-pong's estimate is off by up to half its round trip, and on a loaded
machine even the shortest of a few round trips takes milliseconds (27 ms
seen on 2 busy cores), which shifted a rank's whole timeline by several ms
and made ranks appear to leave collectives before others arrived.

For ranks on other machines: a barrier, then rank 0 plays a few ping-pongs
with each on the control communicator: the reply carrying the shortest round
trip gives that rank's offset (its clock minus rank 0's, assuming symmetric
latency; error at most half the round trip). Every rank also learns rank 0's
time at start, the origin of the timeline's microseconds.
"""

import socket
import time

PINGS = 8


def clock_id() -> str:
    """Which clock ``time.time()`` reads here: the running kernel's boot id (the same for
    every process of one machine, in any container), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def align(comm) -> tuple:
    """Collective over ``comm``: ``(offset, origin, round_trip)`` in seconds for this rank.

    ``offset``: this rank's ``time.time()`` minus rank 0's (0 on rank 0);
    ``origin``: rank 0's ``time.time()`` at start; aligned time of a local
    timestamp ``t`` is ``t - offset - origin``.
    """
    import numpy as np

    rank, size = comm.Get_rank(), comm.Get_size()
    clocks = comm.allgather(clock_id())
    result = np.zeros(3)   # offset, origin, round trip
    if rank == 0:
        buf = np.zeros(1)
        for peer in range(1, size):
            if clocks[peer] == clocks[0]:
                continue   # rank 0's own clock: offset 0, exactly
            best = (float("inf"), 0.0)
            for _ in range(PINGS):
                t0 = time.time()
                comm.Send(buf, dest=peer, tag=71)
                comm.Recv(buf, source=peer, tag=72)
                t1 = time.time()
                if t1 - t0 < best[0]:
                    best = (t1 - t0, float(buf[0]) - (t0 + t1) / 2)
            comm.Send(np.array([best[1], 0.0, best[0]]), dest=peer, tag=73)
        result[1] = time.time()
    elif clocks[rank] != clocks[0]:
        buf = np.zeros(1)
        for _ in range(PINGS):
            comm.Recv(buf, source=0, tag=71)
            buf[0] = time.time()
            comm.Send(buf, dest=0, tag=72)
        comm.Recv(result, source=0, tag=73)
    origin = comm.bcast(float(result[1]) if rank == 0 else None, root=0)
    return float(result[0]), origin, float(result[2])
