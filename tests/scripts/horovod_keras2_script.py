"""An unmodified Horovod Keras 2 script (tf.keras is tf-keras: TF_USE_LEGACY_KERAS=1).

Run as ``matexrun --horovod -n N horovod_keras2_script.py OUT``: each rank
writes OUT.rank<R>.json with its final weights and epoch losses.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd

hvd.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype("float32")
y = x @ np.array([[1.0], [-1.0], [2.0]], "float32")
x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]   # this rank's shard

model = tf.keras.models.Sequential([tf.keras.layers.Dense(8, activation="relu",
                                                          input_shape=(3,)),
                                    tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.legacy.Adam(lr=0.01 * hvd.size())
opt = hvd.DistributedOptimizer(opt)
model.compile(loss="mse", optimizer=opt, experimental_run_tf_function=False)
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback(),
             hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(),
                                                      warmup_epochs=2, verbose=1)]
history = model.fit(x, y, batch_size=8, epochs=3, callbacks=callbacks,
                    verbose=1 if hvd.rank() == 0 else 0)
with open("%s.rank%d.json" % (sys.argv[1], hvd.rank()), "w") as f:
    json.dump({"weights": [w.tolist() for w in model.get_weights()],
               "loss": history.history["loss"], "variables": len(opt.variables())}, f)
