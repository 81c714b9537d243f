"""Test script (never mentions MaTEx): fit/evaluate/predict on generated data.

Usage: keras_fit.py OUT.json INPUT_KIND N_SAMPLES BATCH [shuffle]
INPUT_KIND: arrays | dataset | generator | pydataset. Column 0 of x is the
sample id; a layer counts, inside the model, which samples each rank trained on.
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

out, kind, n, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
shuffle = len(sys.argv) > 5 and sys.argv[5] == "shuffle"
EPOCHS = 3
rng = np.random.default_rng(0)
feats = rng.normal(size=(n, 4)).astype("float32")
x = np.concatenate([np.arange(n, dtype="float32")[:, None], feats], axis=1)
y = (feats.sum(1) > 0).astype("int64")


class CountSamples(keras.layers.Layer):
    def build(self, shape):
        self.seen = self.add_weight(shape=(n,), initializer="zeros", trainable=False,
                                    name="seen")

    def call(self, inputs, training=False):
        if training:
            ids = tf.cast(inputs[:, 0], tf.int32)
            self.seen.assign_add(tf.math.bincount(ids, minlength=n, maxlength=n,
                                                  dtype=tf.float32))
        return inputs[:, 1:]


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((5,)), CountSamples(), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

if kind == "arrays":
    data = dict(x=x, y=y, batch_size=batch, shuffle=shuffle)
elif kind == "dataset":
    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))
elif kind == "generator":
    def gen():
        for epoch in range(EPOCHS):
            for i in range(0, n, batch):
                yield x[i:i + batch], y[i:i + batch]
    data = dict(x=gen(), steps_per_epoch=-(-n // batch))
else:
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-n // batch)

        def __getitem__(self, i):
            return x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
    data = dict(x=Batches())

history = model.fit(epochs=EPOCHS, verbose=0, **data)
loss, acc = model.evaluate(x, y, batch_size=7, verbose=0)
pred = model.predict(x, batch_size=9, verbose=0)
seen = model.layers[0].seen.numpy()
result = {
    "weights": [w.tolist() for w in model.get_weights()[1:]],
    "seen": seen.tolist(),
    "loss": history.history["loss"],
    "evaluate": [loss, acc],
    "pred": pred.tolist(),
}
rank = int(__import__("os").environ.get("OMPI_COMM_WORLD_RANK", "0"))
with open("%s.%d" % (out, rank), "w") as f:
    json.dump(result, f)
