"""Survive losing every rank of one host with plain ULFM (mpi4py: Revoke, Shrink, Agree).

Usage: matexrun --ft ... ulfm_kill_host.py OUTDIR [POST_STEPS]
Every rank allreduces its world rank in a loop and writes OUTDIR/ready<N>.json
(rank, hostname, pid) after a few rounds; the test then SIGKILLs every rank of
one host. Survivors see MPI_ERR_PROC_FAILED or MPI_ERR_REVOKED, revoke the
communicator, shrink it to the survivors, agree, and go on for POST_STEPS
(default 20) allreduces checked against the survivors' ranks; each writes
OUTDIR/done<N>.json with what it saw. Bounded: gives up after 120 s.
"""

import json
import os
import socket
import sys
import time

from mpi4py import MPI

out = sys.argv[1]
post_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
world = MPI.COMM_WORLD
me = world.Get_rank()
# COMM_WORLD itself, not a Dup: a communicator created while the failure
# detector starts up has been seen to abort in ompi_comm_nextcid (Open MPI 5.0.11)
comm = world
comm.Set_errhandler(MPI.ERRORS_RETURN)
FAILED = {MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED, getattr(MPI, "ERR_PROC_FAILED_PENDING", -1)}
started = time.time()
report = {"rank": me, "hostname": socket.gethostname(), "pid": os.getpid(),
          "world_size": world.Get_size()}


def write(name, data):
    tmp = os.path.join(out, ".%s.tmp" % name)
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.rename(tmp, os.path.join(out, name))


rounds, detected, recoveries, post = 0, None, [], []
while time.time() - started < 120:
    try:
        total = comm.allreduce(me)
    except MPI.Exception as exc:
        if exc.Get_error_class() not in FAILED:
            raise
        detected = detected or time.time()
        t0 = time.time()
        try:
            comm.Revoke()
        except MPI.Exception:
            pass                      # another survivor revoked it first
        new = comm.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)
        new.Agree(1)
        group = new.Get_group()
        survivors = MPI.Group.Translate_ranks(group, list(range(new.Get_size())),
                                              world.Get_group())
        recoveries.append({"error": MPI.Get_error_string(exc.Get_error_class()),
                           "seconds": time.time() - t0, "old_size": comm.Get_size(),
                           "new_size": new.Get_size(), "survivors": sorted(survivors)})
        comm = new
        continue
    rounds += 1
    if rounds == 5:
        write("ready%d.json" % me, report)
    if recoveries:
        post.append(total)
        if len(post) >= post_steps:
            break
    time.sleep(0.005)

report.update(rounds=rounds, recoveries=recoveries, detected=detected, post_sums=post,
              size=comm.Get_size(),
              expected_sum=sum(recoveries[-1]["survivors"]) if recoveries else None,
              seconds=time.time() - started)
write("done%d.json" % me, report)
print("rank %d on %s: %d rounds, recoveries %s" % (me, report["hostname"], rounds, recoveries),
      flush=True)
