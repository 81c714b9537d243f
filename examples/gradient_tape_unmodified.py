"""An ordinary TensorFlow custom training loop that never mentions MaTEx.

    matexrun -n 2 examples/gradient_tape_unmodified.py

Under `python -m matex` the optimizer averages gradients over ranks and the
first step starts from rank 0's weights. The loop's data is NOT sharded
automatically (every rank sees this whole dataset, which keeps the result
equal to one process); to split it, use `matex.shard(dataset)`.
"""

import numpy as np
import tensorflow as tf

rng = np.random.default_rng(1)
x = rng.normal(size=(1024, 8)).astype("float32")
y = (x @ np.linspace(-1, 1, 8).astype("float32"))[:, None]
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
tf.keras.utils.set_random_seed(0)

model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="tanh"),
                             tf.keras.layers.Dense(1)])
optimizer = tf.keras.optimizers.SGD(0.05)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for epoch in range(5):
    for xb, yb in data:
        loss = train_step(xb, yb)
    print("epoch %d loss %.5f" % (epoch + 1, float(loss)))
print("weights checksum %.10f" % sum(float(np.abs(w).sum()) for w in model.get_weights()))
