"""Test script written for Horovod's elastic API: gradient accumulation under rank loss.

Usage: matexrun --ft --horovod ... elastic_accumulate.py OUT CALLS

``hvd.DistributedOptimizer(SGD(1), backward_passes_per_step=2)`` on one weight
``w`` (a Dense(1) without bias, from 0) whose gradient is exactly 1 on every
rank in every call (the loss is the mean output over a batch of ones): every
second call reduces the two accumulated gradients (average over ranks: 2) and
applies them, so after CALLS calls (even) ``w == -CALLS`` exactly, whatever the
ranks lost on the way, if each call's gradient is accumulated exactly once.
``hvd.elastic.run`` commits after every call. Every rank that finishes writes
OUT.<world rank> (JSON): ``w``, the optimizer's ``iterations``, the
accumulation counter, the number of ranks.
"""

import json
import os
import sys

import keras
import tensorflow as tf

import horovod.tensorflow as hvd

hvd.init()
out, calls = sys.argv[1], int(sys.argv[2])
model = keras.Sequential([keras.Input((1,)),
                          keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
ones = tf.ones((4, 1))


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(ones))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)


@hvd.elastic.run
def train(state):
    while state.batch < calls:
        train_step()
        state.batch += 1
        state.commit()


train(state)
counter = optimizer._matex.strategy.counter
with open("%s.%s" % (out, os.environ.get("OMPI_COMM_WORLD_RANK", "0")), "w") as f:
    json.dump({"w": float(model.layers[0].kernel.numpy()[0, 0]), "batch": state.batch,
               "iterations": int(optimizer.iterations.numpy()),
               "counter": int(counter.numpy()), "size": hvd.size()}, f)
