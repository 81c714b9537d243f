"""Give every rank the same starting point: rank ``root``'s variables."""

import keras

from matex import _collectives


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank rank ``root``'s model variables.

    Covers non-trainable variables (e.g. BatchNorm statistics) and the
    optimizer's state when it already exists. Added automatically by
    ``matex.keras``/``python -m matex``.
    """

    def __init__(self, root: int = 0) -> None:
        super().__init__()
        self.root = root
        self._done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        _collectives.broadcast_variables(variables, self.root)
        self._done = True
