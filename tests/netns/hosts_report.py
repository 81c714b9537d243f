"""Each rank reports where it runs and checks allreduce across hosts.

Usage: hosts_report.py OUTDIR [--no-tf]
Writes OUTDIR/rank<N>.json: rank, size, hostname, MPI processor name, the
sum of an mpi4py allreduce, its latency (1 float) and bandwidth (4 MiB), and
(unless --no-tf) the same through MaTEx's TensorFlow allreduce op.
"""

import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

out = sys.argv[1]
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
report = {"rank": rank, "size": size, "hostname": socket.gethostname(),
          "processor": MPI.Get_processor_name(), "pid": os.getpid()}


def timed(fn, reps):
    for _ in range(3):
        fn()
    comm.Barrier()
    started = time.perf_counter()
    for _ in range(reps):
        result = fn()
    return result, (time.perf_counter() - started) / reps


one = np.array([rank + 1.0])
total, latency = timed(lambda: comm.allreduce(one), 200)
report["mpi_sum"] = float(total[0])
report["mpi_latency_us"] = latency * 1e6
big = np.full(1 << 20, float(rank + 1), dtype=np.float32)     # 4 MiB
big_out = np.empty_like(big)
_, seconds = timed(lambda: comm.Allreduce(big, big_out), 10)
report["mpi_4mib_ok"] = bool(np.all(big_out == size * (size + 1) / 2))
report["mpi_4mib_ms"] = seconds * 1e3

if "--no-tf" not in sys.argv:
    import tensorflow as tf

    import matex

    value = tf.constant([float(rank + 1), 2.0 ** rank], tf.float64)
    summed, op_latency = timed(lambda: matex.allreduce(value, op="sum"), 50)
    report["matex_sum"] = summed.numpy().tolist()
    report["matex_latency_us"] = op_latency * 1e6
    gathered = matex.allgather(tf.constant([[rank]] * (rank + 1), tf.int32))
    report["matex_allgather"] = gathered.numpy().ravel().tolist()
    report["matex_rank"], report["matex_size"] = matex.rank(), matex.size()
    report["local_rank"], report["local_size"] = matex.local_rank(), matex.local_size()

with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
    json.dump(report, f)
print("rank %d on %s: sum %s, latency %.1f us" % (rank, report["hostname"], report["mpi_sum"],
                                                 report["mpi_latency_us"]), flush=True)
