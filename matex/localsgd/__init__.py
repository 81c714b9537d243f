"""Fewer synchronisations: Local SGD and DiLoCo (issue #14).

    model.compile(optimizer=matex.LocalSGD(keras.optimizers.SGD(0.1), sync_every=8), ...)
    model.compile(optimizer=matex.DiLoCo(keras.optimizers.AdamW(1e-3),
                                         keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True),
                                         sync_every=32), ...)

Both return the (inner) optimizer, converted in place; ranks communicate once
every ``sync_every`` steps instead of every step. Under ``matexrun --ft`` a rank
failure rolls every survivor back to the last synchronisation and training
goes on from there. See ``_local_sgd`` and ``_diloco``.
"""

from matex.localsgd._diloco import DiLoCo
from matex.localsgd._local_sgd import LocalSGD

__all__ = ["LocalSGD", "DiLoCo"]
