"""Test script written for Horovod's elastic API: gradient accumulation under rank loss.

Usage: matexrun --ft --horovod ... elastic_accumulate.py OUT CALLS [keras2]

``hvd.DistributedOptimizer(SGD(1), backward_passes_per_step=2)`` on one weight
``w`` (a Dense(1) without bias, from 0) whose gradient is exactly 1 on every
rank in every call (the loss is the mean output over a batch of ones): every
second call reduces the two accumulated gradients (average over ranks: 2) and
applies them, so after CALLS calls (even) ``w == -CALLS`` exactly, whatever the
ranks lost on the way, if each call's gradient is accumulated exactly once.
``hvd.elastic.run`` commits after every call. Every rank that finishes writes
OUT.<world rank> (JSON): ``w``, the optimizer's ``iterations``, the
accumulation counter, the number of ranks. With ``keras2``, the model and the
optimizer are Keras 2's (tf-keras), whose distributed optimizer is another class
and reduces in ``minimize`` (as Horovod's: its ``apply_gradients`` alone reduces nothing).
"""

import json
import os
import sys

import tensorflow as tf

import horovod.tensorflow as hvd

hvd.init()
out, calls = sys.argv[1], int(sys.argv[2])
keras2 = sys.argv[3:] == ["keras2"]
if keras2:
    import tf_keras as keras
else:
    import keras
model = keras.Sequential([keras.Input((1,)),
                          keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
ones = tf.ones((4, 1))


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(ones))
    if keras2:   # Horovod's Keras 2 optimizer reduces in compute_gradients (minimize, fit)
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return
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
counter = (optimizer._matex_reduction if keras2 else optimizer._matex.strategy).counter
with open("%s.%s" % (out, os.environ.get("OMPI_COMM_WORLD_RANK", "0")), "w") as f:
    json.dump({"w": float(model.layers[0].kernel.numpy()[0, 0]), "batch": state.batch,
               "iterations": int(optimizer.iterations.numpy()),
               "counter": int(counter.numpy()), "size": hvd.size()}, f)
