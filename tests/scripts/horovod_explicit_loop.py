"""A Horovod custom loop through ``import matex.horovod...`` (no ``--horovod``), run by
``python -m matex`` (transparent mode): PartialDistributedGradientTape with a local layer
and a plain Keras optimizer. Writes each rank's weights to ``argv[1].rank<N>.json``."""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import matex.horovod.tensorflow as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
shared = keras.layers.Dense(1, name="shared", kernel_initializer="ones")
local = keras.layers.Dense(2, name="local", kernel_initializer="ones")
model = keras.Sequential([keras.Input((3,)), local, shared])
optimizer = keras.optimizers.SGD(0.1)
x = tf.constant(np.full((4, 3), R + 1.0, np.float32))
for _ in range(2):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
with open("%s.rank%d.json" % (sys.argv[1], R), "w") as f:
    json.dump({"size": N, "local": local.kernel.numpy().tolist(),
               "shared": shared.kernel.numpy().tolist()}, f)
