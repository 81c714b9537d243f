"""Cost of ``hvd.join()``'s announcements in ``matex.horovod``, with and without them.

Usage: mpiexec -n 2 python benchmarks/horovod_join.py [--reps N]

Every join-aware reduction of the Horovod compat layer is announced by one small
int64 allreduce, so that a rank that has joined can serve it with zeros
(``matex/horovod/_join.py``); ``MATEX_HOROVOD_JOIN=0`` turns that off. This
measures both in one run, alternating, on the same ranks: an eager
``hvd.allreduce`` of 4 floats, and a traced ``DistributedGradientTape`` step of
a 32-64-1 Dense model. Prints microseconds per call (best of 3 rounds) and the
ratio with/without, on rank 0.
"""

import argparse
import os
import time

import keras
import tensorflow as tf

import matex.horovod.tensorflow as hvd


def best_of(fn, reps, rounds=3):
    """Best mean time of ``fn()`` in microseconds over ``rounds`` rounds of ``reps`` calls."""
    times = []
    for _ in range(rounds):
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps * 1e6)
    return min(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=500)
    reps = parser.parse_args().reps
    hvd.init()
    small = tf.ones([4])
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    x, y = tf.ones([8, 32]), tf.ones([8, 1])

    def make_step():
        """A new tf.function: the announcements are decided when it is traced."""
        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return step

    results = {}
    for setting in ("0", "1", "0", "1"):    # alternating: load drifts hit both alike
        os.environ["MATEX_HOROVOD_JOIN"] = setting
        step = make_step()
        for _ in range(20):                  # warm-up, and the trace under this setting
            hvd.allreduce(small)
            step()
        eager = best_of(lambda: hvd.allreduce(small), reps)
        traced = best_of(step, max(reps // 2, 1))
        old = results.get(setting, (float("inf"), float("inf")))
        results[setting] = (min(old[0], eager), min(old[1], traced))
    if hvd.rank() == 0:
        (e0, t0), (e1, t1) = results["0"], results["1"]
        print("ranks %d: eager hvd.allreduce(4 floats) %.0f us without announcements, %.0f us "
              "with (%.2fx); traced tape step %.0f us without, %.0f us with (%.2fx)"
              % (hvd.size(), e0, e1, e1 / e0, t0, t1, t1 / t0))


if __name__ == "__main__":
    main()
