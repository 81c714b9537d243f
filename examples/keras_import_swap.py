"""A Keras script made distributed by one changed import.

    matexrun -n 2 examples/keras_import_swap.py      (or: mpiexec -n 2 python examples/...)

Identical to a single-process Keras script except the first import line:
`batch_size` is the global batch, metrics are global, only rank 0 prints and
writes the checkpoint, the CSV log, the backups and the saved model and
weights.
"""

import os
import sys

import matex.keras as keras          # was: import keras
from matex.keras import layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import CLASSES, make_shapes  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "shapes-run"
os.makedirs(out, exist_ok=True)
x, y = make_shapes(6000, seed=1)
x_test, y_test = make_shapes(1000, seed=2)
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((16, 16, 1)),
    layers.Conv2D(16, 3, activation="relu"),
    layers.MaxPooling2D(),
    layers.Flatten(),
    layers.Dense(len(CLASSES)),
])
model.compile(optimizer=keras.optimizers.Adam(2e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model.fit(x, y, batch_size=64, epochs=3, validation_split=0.1,
          callbacks=[keras.callbacks.ModelCheckpoint(os.path.join(out, "best.keras")),
                     keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
                     keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))])
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
print("test accuracy %.4f" % accuracy)
model.save(os.path.join(out, "final.keras"))
model.save_weights(os.path.join(out, "final.weights.h5"))
restored = keras.models.load_model(os.path.join(out, "final.keras"))
print("restored model agrees: %s" % bool(
    abs(restored.evaluate(x_test, y_test, verbose=0)[1] - accuracy) < 1e-6))
