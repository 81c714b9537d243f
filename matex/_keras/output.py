"""One writer: progress, file-writing callbacks and saving on rank 0; loading shared from it.

Rank 0 is whoever is rank 0 *now*: after a rank loss the new rank 0 writes.
Loading reads the file on rank 0 and broadcasts it, so ranks whose disks lack
the file still load, and a failure to read on rank 0 is raised on every rank.
"""

import functools
import os
import tempfile

import keras

from matex import _collectives, _runtime
from matex._keras.calls import bind, call

# callbacks that write files or print: only rank 0 keeps them (subclasses too)
WRITERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger,
           keras.callbacks.TensorBoard, keras.callbacks.ProgbarLogger,
           keras.callbacks.RemoteMonitor)


def quiet(verbose):
    """``verbose`` on rank 0, silence elsewhere."""
    return verbose if _runtime.rank() == 0 else 0


def rank0_callbacks(callbacks):
    """Callbacks for this rank: file writers and progress only on rank 0.

    Keras's own ``CallbackList`` (passed from ``fit`` to ``evaluate``) is
    already filtered and stays as it is.
    """
    if not isinstance(callbacks, (list, tuple)) or _runtime.rank() == 0:
        return callbacks
    return [cb for cb in callbacks if not isinstance(cb, WRITERS)]


def explicit(model, original, args, kwargs):
    """For explicitly distributed models: only rank-0 output; data untouched."""
    bound = bind(original, model, *args, **kwargs)
    bound.arguments["verbose"] = quiet(bound.arguments["verbose"])
    bound.arguments["callbacks"] = rank0_callbacks(bound.arguments["callbacks"])
    return call(original, bound)


def rank0_write(original):
    """Run ``original`` on rank 0 only.

    No barrier: saving is often called on rank 0 alone (a checkpoint
    callback), and loading reads on rank 0 and broadcasts, so no rank ever
    needs to wait for the file.
    """
    @functools.wraps(original)
    def write(*args, **kwargs):
        return original(*args, **kwargs) if _runtime.rank() == 0 else None

    return write


def _from_rank0(read):
    """``read()`` on rank 0: ``(ok, value or message, rank 0's exception or None)`` everywhere."""
    outcome, error = None, None
    if _runtime.rank() == 0:
        try:
            outcome = (True, read())
        except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
            outcome, error = (False, "%s: %s" % (type(exc).__name__, exc)), exc
    ok, value = _runtime.control().bcast(outcome, root=0)
    return ok, value, error


def load_model(original):
    @functools.wraps(original)
    def load(filepath, *args, **kwargs):
        def read():
            with open(filepath, "rb") as f:
                return f.read()

        ok, data, _ = _from_rank0(read)
        if not ok:
            raise OSError("cannot read %s on rank 0: %s" % (filepath, data))
        if _runtime.rank() == 0:
            return original(filepath, *args, **kwargs)
        suffix = os.path.splitext(str(filepath))[1]
        with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
            tmp.write(data)
            tmp.flush()
            return original(tmp.name, *args, **kwargs)

    return load


def load_weights(original):
    @functools.wraps(original)
    def load(self, *args, **kwargs):
        ok, failure, error = _from_rank0(lambda: original(self, *args, **kwargs) and None)
        if error is not None:
            raise error
        if not ok:
            raise OSError("cannot load weights on rank 0: %s" % failure)
        _collectives.broadcast_variables(self.variables, 0)

    return load
