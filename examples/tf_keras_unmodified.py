"""An ordinary tf.keras script that never mentions MaTEx.

    matexrun -n 2 examples/tf_keras_unmodified.py     (= mpiexec -n 2 python -m matex ...)
"""

import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.normal(size=(2000, 20)).astype("float32")
y = (x[:, :10].sum(1) > x[:, 10:].sum(1)).astype("int64")

tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((20,)),
                             tf.keras.layers.Dense(32, activation="relu"),
                             tf.keras.layers.Dense(2)])
model.compile(optimizer="adam",
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model.fit(x, y, batch_size=50, epochs=4, verbose=2)
print("weights checksum %.10f" % sum(float(np.abs(w).sum()) for w in model.get_weights()))
print("accuracy %.4f" % model.evaluate(x, y, verbose=0)[1])
