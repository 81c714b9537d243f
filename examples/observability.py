"""Seeing inside a run: a timeline of every rank, live monitor figures and bytes on the wire.

    matexrun -n 2 examples/observability.py
    matexrun -n 2 examples/observability.py --rows 1024 --epochs 1 --timeline /tmp/tl

Trains a small classifier with ``matex.keras`` while

* ``matex.timeline.start(DIR)`` makes every rank write
  ``DIR/timeline-rank<N>.json`` (steps, their forward/allreduce/apply phases,
  every collective with its wait and transfer); after training rank 0 merges
  them into ``DIR/merged.json``, one row per rank, to open in
  https://ui.perfetto.dev (what ``python -m matex.timeline merge DIR`` does);
* ``MonitorCallback`` prints the job's samples/s, the slowest rank and the
  allreduce share every ``--interval`` seconds and puts them in the History
  (``matexrun --monitor`` adds it to any ``fit``);
* ``matex.stats()`` counts the gradient bytes each rank handed to MPI.

Rank 0 prints, after the monitor's lines::

    timeline: DIR/merged.json, ranks [0, 1], 64 training steps (32/32 per rank), 216 collectives
    monitor: 4686 samples/s, slowest rank 1, allreduce 71% of a step
    gradients: 9488 bytes per step and rank over 32 steps

(``--rows 1024 --epochs 2`` on a loaded 2-core machine.)

``python -m matex.flight DIR`` and the stall inspector, the other two tools,
are shown in docs/troubleshooting.md (they speak when something goes wrong).
"""

import argparse
import collections
import json
import os

import numpy as np

import matex
import matex.keras as keras
import matex.timeline
from matex.callbacks import MonitorCallback
from matex.timeline.__main__ import main as timeline_tool


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeline", default="matex-timeline", help="folder for the traces")
    parser.add_argument("--interval", type=float, default=2.0, help="monitor period, seconds")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 32)).astype("float32")
    y = (x[:, :8] @ rng.normal(size=(8, 4))).argmax(axis=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    matex.timeline.start(args.timeline)          # collective: every rank
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0,
                        callbacks=[MonitorCallback(global_batch=64, interval=args.interval)])
    matex.timeline.stop()
    matex.comm().Barrier()                       # every rank's file is complete
    stats = matex.stats()
    if matex.rank() != 0:
        return
    timeline_tool(["merge", args.timeline])
    merged = os.path.join(args.timeline, "merged.json")
    with open(merged) as f:
        events = json.load(f)
    steps = collections.Counter(e["pid"] for e in events if e.get("cat") == "step")
    collectives = sum(1 for e in events if e.get("cat") == "collective")
    print("timeline: %s, ranks %s, %d training steps (%s per rank), %d collectives"
          % (merged, sorted(steps), sum(steps.values()),
             "/".join(str(steps[r]) for r in sorted(steps)), collectives))
    logs = history.history
    print("monitor: %.0f samples/s, slowest rank %d, allreduce %.0f%% of a step"
          % (logs["matex_samples_per_s"][-1], logs["matex_slowest_rank"][-1],
             100 * logs["matex_allreduce_share"][-1]))
    print("gradients: %d bytes per step and rank over %d steps"
          % (stats["bytes_sent_per_step"], stats["steps"]), flush=True)


if __name__ == "__main__":
    main()
