"""Files larger than the memory budget stream: an epoch stays within the budget.

Memory is the process's anonymous resident memory (what the reader
allocates), sampled every millisecond during the epoch. Pages of
memory-mapped files are the kernel's page cache and are not counted.
"""

import gc
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import matex
from matex.readers import DataSet

R, N = matex.rank(), matex.size()
BUDGET = 8 << 20
ROWS, COLUMNS = 1 << 17, 64             # 32 MB of float32 features: 4x the budget


@pytest.fixture(scope="module")
def shared():
    """The files, written by rank 0 into a directory all ranks share; removed after."""
    base = os.environ.get("MATEX_TEST_REPORT_DIR")
    if R == 0:
        path = os.path.join(base, "streaming-data") if base else tempfile.mkdtemp()
        os.makedirs(path, exist_ok=True)
        features = np.arange(ROWS * COLUMNS, dtype=np.float32).reshape(ROWS, COLUMNS) / COLUMNS
        with h5py.File(os.path.join(path, "big.h5"), "w") as f:
            f["x"] = features
            f["y"] = np.arange(ROWS)
            f.create_dataset("cx", data=features, chunks=(512, COLUMNS), compression="gzip",
                             compression_opts=1)
        block = "".join(",".join(str(i * 7 + j) for j in range(24)) + "\n" for i in range(1000))
        with open(os.path.join(path, "big.csv"), "w") as f:
            f.write(block * (4 * BUDGET // len(block) + 1))
        with h5py.File(os.path.join(path, "small.h5"), "w") as f:
            f["x"] = features[:4096]
            f["y"] = np.arange(4096)
            f.create_dataset("cx", data=features[:4096], chunks=(512, COLUMNS),
                             compression="gzip")
        with open(os.path.join(path, "small.csv"), "w") as f:
            f.write(block * 4)
    path = matex.comm().bcast(path if R == 0 else None, root=0)
    yield Path(path)
    matex.comm().Barrier()
    if R == 0:
        shutil.rmtree(path, ignore_errors=True)


def anonymous():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """Highest anonymous resident memory above the level on entry, sampled every ms."""

    def __enter__(self):
        gc.collect()
        self.base = self.peak = anonymous()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous())

    @property
    def extra(self):
        return self.peak - self.base


def one_epoch(source, **options):
    ds = DataSet(source, per_rank_batch_size=64, memory_budget=BUDGET, **options)
    steps = 0
    for group in ds.train:
        steps += 1
    expected = ds.steps_per_epoch
    ds.close()
    return steps, expected


CASES = {
    "hdf5-contiguous": ("h5", dict(features="x", labels="y")),
    "hdf5-chunked-gzip": ("h5", dict(features="cx", labels="y")),
    "csv": ("csv", dict(features=None, labels=0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_epoch_over_a_file_four_times_the_budget_stays_within_it(shared, case):
    suffix, options = CASES[case]
    one_epoch(str(shared / ("small." + suffix)), **options)      # one-time costs: TF, pandas
    big = shared / ("big." + suffix)
    assert big.stat().st_size >= 4 * BUDGET * 0.95
    with Peak() as peak:
        steps, expected = one_epoch(str(big), **options)
    everyone = matex.comm().allgather((steps, expected, peak.extra))
    assert {(s, e) for s, e, _ in everyone} == {(expected, expected)}
    worst = max(extra for _, _, extra in everyone)
    assert worst < BUDGET, "peak extra memory (MB per rank) %s over the %.1f MB budget" % (
        [round(extra / 2**20, 2) for _, _, extra in everyone], BUDGET / 2**20)
