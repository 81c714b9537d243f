"""Cost of choosing what to send: RandomK's positions against TopK's selection.

    python benchmarks/compression_select.py            # 2^20-element gradient, 1 %
    python benchmarks/compression_select.py --quick    # smoke run

Two ranks. Per variant, ms per call in a ``tf.function`` (median of rounds
taken round-robin, the worse rank): the selection alone (RandomK's k draws
now; RandomK's former ranking of n uniform numbers; TopK's ``top_k`` of
``|g|``), and a whole ``reduce`` of one gradient by each compressor (the
selection, the exchange and the scatter back). Ratios are against TopK,
measured in the same run.
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

RATIO = 0.01


def _timed(fn, arg, calls):
    def once():
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(arg)
        _ = [o.numpy() for o in (out if isinstance(out, (list, tuple)) else [out])]
        return (time.perf_counter() - start) / calls * 1e3
    return once


def worker(args):
    import numpy as np
    import tensorflow as tf

    import matex
    from matex.compression import RandomK, TopK, _randomk
    from matex.compression._base import Item

    n = 1 << 16 if args.quick else 1 << 20
    rounds, calls = (3, 3) if args.quick else (7, 10)
    k = int(math.ceil(RATIO * n))
    grad = tf.constant(np.random.default_rng(matex.rank()).standard_normal(n)
                       .astype(np.float32).reshape(-1, 256))
    step = tf.constant(3, tf.int64)
    seed = tf.stack([tf.constant(1234, tf.int64), step])

    select = {
        "randomk_draws": tf.function(lambda s: _randomk.positions(s, k, n)),
        "randomk_ranking": tf.function(lambda s: tf.math.top_k(
            tf.random.stateless_uniform([n], s), k, sorted=False).indices),
        "topk": tf.function(lambda g: tf.math.top_k(tf.abs(tf.reshape(g, [-1])), k,
                                                    sorted=False).indices),
    }
    args_of = {"randomk_draws": seed, "randomk_ranking": seed, "topk": grad}
    selection = _common.interleave({name: _timed(f, args_of[name], calls)
                                    for name, f in select.items()}, rounds)

    compressors = {"randomk": RandomK(RATIO), "topk": TopK(RATIO)}
    reduce_fns = {name: tf.function(lambda g, c=c: c.reduce([Item(g, None, "g")],
                                                            "average", None)[0])
                  for name, c in compressors.items()}
    whole = _common.interleave({name: _timed(f, grad, calls)
                                for name, f in reduce_fns.items()}, rounds)
    result = {"n": n, "k": k, "select_ms": selection, "reduce_ms": whole}
    _common.emit(_common.worst_over_ranks(matex.comm(), result), matex.rank())


def report(results):
    r = results["worker"]
    sel, red = r["select_ms"], r["reduce_ms"]
    lines = ["%d-element float32 gradient, k = %d (%g), 2 ranks: ms per call (median, worse "
             "rank)" % (r["n"], r["k"], RATIO)]
    lines.append(_common.table(
        ["what", "ms", "/ TopK"],
        [["select: RandomK, k draws (now)", "%.3f" % sel["randomk_draws"],
          "%.3f" % (sel["randomk_draws"] / sel["topk"])],
         ["select: RandomK, rank n uniforms (before)", "%.3f" % sel["randomk_ranking"],
          "%.3f" % (sel["randomk_ranking"] / sel["topk"])],
         ["select: TopK, top_k of |g|", "%.3f" % sel["topk"], "1.000"],
         ["reduce: RandomK", "%.3f" % red["randomk"], "%.3f" % (red["randomk"] / red["topk"])],
         ["reduce: TopK", "%.3f" % red["topk"], "1.000"]]))
    lines.append(_common.target("RandomK's selection cheaper than TopK's",
                                sel["randomk_draws"] < sel["topk"],
                                "%.3fx" % (sel["randomk_draws"] / sel["topk"])))
    return "\n".join(lines)


def main():
    _common.single_phase_main(__file__, __doc__, worker, report,
                              "Compression: selection cost")


if __name__ == "__main__":
    main()
