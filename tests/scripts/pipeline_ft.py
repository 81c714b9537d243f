"""A 2-stage pipeline whose rank 1 is SIGKILLed in the middle of fit (run under ULFM).

Rank 0 must end with ``matex.errors.RankFailure`` naming rank 1, not hang:
it prints PIPELINE-FAILURE <message> and exits 3.
"""

import os
import signal
import sys

import keras
import numpy as np

import matex
from matex.errors import RankFailure
from matex.parallel import PipelineModel, StageBoundary


class Die(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3 and matex.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"),
                          StageBoundary(name="cut"), keras.layers.Dense(2, name="b")])
pm = PipelineModel(model, microbatches=2)
pm.compile(optimizer="sgd", loss="mse")
x = np.zeros((64, 4), "float32")
y = np.zeros((64, 2), "float32")
try:
    pm.fit(x, y, batch_size=8, epochs=2, callbacks=[Die()], verbose=0)
except RankFailure as exc:
    print("PIPELINE-FAILURE %s" % exc, flush=True)
    sys.exit(3)
print("PIPELINE-FINISHED", flush=True)
