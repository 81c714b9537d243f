"""Sparse allreduce (SparCML) against an allgather of (index, value) pairs and a dense
allreduce of the same data, across densities; where sparse stops paying (the crossover);
and an embedding gradient (tf.IndexedSlices) densified-then-allreduced (MaTEx before #14)
against the sparse allreduce (now).

    python benchmarks/sparse_allreduce.py            # 2 ranks, 1 M float32 rows
    python benchmarks/sparse_allreduce.py --quick    # smoke run

Every variant is an eager call timed round-robin (``_common.interleave``);
figures are median ms per call, the worse of the ranks. The sparse variant
never switches to dense (``density_threshold=2``), so the crossover it shows is
what the default switch point (``matex._sparse.DENSE_BYTES_RATIO``) is set
from. ``measure(densities, ...)`` is importable (inside an MPI job) by other
benchmarks, e.g. over TCP.
"""

import _common

DENSITIES = (0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5)


def measure(densities=DENSITIES, rows=1 << 20, row_elems=1, rounds=7, calls=3):
    """{density: {"sparse_ms", "allgather_ms", "dense_ms", "sparse_bytes", "dense_bytes"}}.

    Run on every rank of an MPI job; each rank brings ``density * rows`` random
    distinct rows (its own draw). Times are this rank's medians (take the worst
    over ranks with ``_common.worst_over_ranks``).
    """
    import numpy as np
    import tensorflow as tf

    import matex
    from matex import _sparse

    rank = matex.rank()
    out = {}
    for density in densities:
        rng = np.random.default_rng([rank, int(density * 1e6)])
        n = max(1, int(density * rows))
        idx = tf.constant(np.sort(rng.choice(rows, n, replace=False)).astype(np.int64))
        shape = [n] if row_elems == 1 else [n, row_elems]
        vals = tf.constant(rng.standard_normal(shape).astype(np.float32))
        dense = tf.convert_to_tensor(tf.IndexedSlices(vals, idx, [rows] + shape[1:]))
        sent = {}

        def sparse():
            sent["b"] = int(_sparse.exchange(idx, vals, rows, density_threshold=2.0)[3])

        def allgather():
            matex.allgather(idx)
            matex.allgather(vals)

        def dense_allreduce():
            matex.allreduce(dense, op="sum")

        variants = {"sparse_ms": sparse, "allgather_ms": allgather, "dense_ms": dense_allreduce}
        timed = {k: (lambda f=f: _common.per_call(f, calls, matex.comm().Barrier) * 1e3)
                 for k, f in variants.items()}
        out[str(density)] = dict(_common.interleave(timed, rounds),
                                 sparse_bytes=sent.get("b", 0),
                                 dense_bytes=rows * row_elems * 4)
    return out


def crossover(results):
    """The smallest density at which the sparse allreduce is no faster than dense, or None."""
    for density in sorted(results, key=float):
        if results[density]["sparse_ms"] >= results[density]["dense_ms"]:
            return float(density)
    return None


def embedding(rows, dim, touched, rounds, calls):
    """An embedding gradient: densified + dense allreduce vs the sparse allreduce."""
    import numpy as np
    import tensorflow as tf

    import matex
    from matex import _sparse

    rng = np.random.default_rng(matex.rank())
    ids = tf.constant(rng.integers(0, rows, touched))
    values = tf.constant(rng.standard_normal((touched, dim)).astype(np.float32))
    slices = tf.IndexedSlices(values, ids, tf.constant([rows, dim], tf.int64))
    sent = {}

    def before():
        matex.allreduce(tf.convert_to_tensor(slices), op="average")

    def after():
        sent["b"] = int(_sparse.reduce_slices(values, ids, [rows, dim])[1])

    timed = {k: (lambda f=f: _common.per_call(f, calls, matex.comm().Barrier) * 1e3)
             for k, f in {"densified_ms": before, "sparse_ms": after}.items()}
    return dict(_common.interleave(timed, rounds), sparse_bytes=sent["b"],
                densified_bytes=rows * dim * 4)


def worker(args):
    import matex

    quick = args.quick
    rows = 1 << 16 if quick else 1 << 20
    result = {
        "scalar": measure(DENSITIES, rows, 1, 3 if quick else 7, 2 if quick else 3),
        "rows16": measure(DENSITIES[1:], rows // 16, 16, 3 if quick else 7, 2 if quick else 3),
        "embedding": embedding(10_000 if quick else 100_000, 64, 1024, 3 if quick else 7,
                               2 if quick else 3),
    }
    _common.emit(_common.worst_over_ranks(matex.comm(), result), matex.rank())


def report(results):
    results = results["worker"]
    lines = []
    for key, label in (("scalar", "scalar rows"), ("rows16", "rows of 16 float32")):
        res = results[key]
        rows = [[d, "%.3f" % r["sparse_ms"], "%.3f" % r["allgather_ms"], "%.3f" % r["dense_ms"],
                 "%.2f" % (r["dense_ms"] / r["sparse_ms"]),
                 "%.3f" % (r["sparse_bytes"] / r["dense_bytes"])]
                for d, r in sorted(res.items(), key=lambda kv: float(kv[0]))]
        lines.append("%s, 2 ranks: ms per call (median, worse rank)" % label)
        lines.append(_common.table(["density", "sparse ms", "allgather ms", "dense ms",
                                    "dense/sparse", "sparse bytes / dense"], rows))
        cross = crossover(res)
        lines.append("crossover density (%s): %s" % (label, cross if cross else "> 0.5"))
        lines.append("")
    e = results["embedding"]
    lines.append("embedding gradient (IndexedSlices), 2 ranks:")
    lines.append(_common.table(
        ["path", "ms", "bytes sent"],
        [["densified + allreduce (before)", "%.3f" % e["densified_ms"],
          "%d" % e["densified_bytes"]],
         ["sparse allreduce (now)", "%.3f" % e["sparse_ms"], "%d" % e["sparse_bytes"]]]))
    lines.append(_common.target("sparse allreduce faster than densify+allreduce for the "
                                "embedding gradient", e["sparse_ms"] < e["densified_ms"],
                                "%.2fx" % (e["densified_ms"] / e["sparse_ms"])))
    return "\n".join(lines)


def main():
    _common.single_phase_main(__file__, __doc__, worker, report, "Sparse allreduce")


if __name__ == "__main__":
    main()
