"""A 2-way tensor-parallel model whose rank 1 is SIGKILLed in the middle of fit (ULFM).

MaTEx's recovery would shrink the data communicator and go on, but the lost
rank's half of the layers exists nowhere else: rank 0 must end with
``matex.errors.RankFailure`` naming rank 1, not hang and not train on. It
prints TP-FAILURE <message> and exits 3.
"""

import os
import signal
import sys

import numpy as np

import matex
import matex.keras as keras
import matex.parallel as mp
from matex.errors import RankFailure


class Die(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3 and g.tensor_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


g = mp.grid(tensor=2)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), mp.ColumnParallelDense(8, gather_output=False),
                          mp.RowParallelDense(2)])
model.compile(optimizer=matex.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
x = np.zeros((64, 4), "float32")
y = np.zeros((64, 2), "float32")
try:
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[Die()], verbose=0)
except RankFailure as exc:
    print("TP-FAILURE %s" % exc, flush=True)
    sys.exit(3)
print("TP-FINISHED", flush=True)
