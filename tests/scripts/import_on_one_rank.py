"""Test script: `import matex.keras` on rank 0 only (a mistake), run with plain `python`."""

import os
import time

if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
    import matex.keras  # noqa: F401
    print("imported", flush=True)
else:
    from mpi4py import MPI  # noqa: F401 - the other ranks start MPI and do other work

    time.sleep(2)
