"""Checkpoints that are never half-written, and restores that rank 0's files decide.

``AtomicBackupAndRestore`` is Keras's ``BackupAndRestore`` with two changes:
files are written under a temporary name and renamed into place (a rank dying
mid-write leaves the previous checkpoint intact), and whether a checkpoint
exists is decided on rank 0 and broadcast, so all ranks restore the same state
even when their view of the file system differs. ``fit`` adds it by itself
when ``MATEX_CHECKPOINT_DIR`` is set (``matexrun --restart``). A plain
``BackupAndRestore`` restores the same way (``restore_on_train_begin``).
"""

import json
import os

import keras

from matex import _collectives, _compat, _faults, _runtime


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """Back up weights and epoch every epoch; resume from them at the next ``fit``."""

    def _save_model(self):
        if _runtime.rank() != 0:
            return
        paths = _compat.backup_paths(self)
        epoch, batch = _compat.backup_position(self)
        os.makedirs(self.backup_dir, exist_ok=True)
        weights_tmp = os.path.join(self.backup_dir, "incoming.weights.h5")
        meta_tmp = paths["meta"] + ".incoming"
        self.model.save_weights(filepath=weights_tmp, overwrite=True)
        with open(meta_tmp, "w") as f:
            json.dump({"epoch": epoch, "batch": batch}, f)
            f.flush()
            os.fsync(f.fileno())
        _faults.maybe_fail(int(self.model.optimizer.iterations), "checkpoint")
        os.replace(weights_tmp, paths["weights"])
        os.replace(meta_tmp, paths["meta"])

    def on_train_begin(self, logs=None):
        if restore(self) and _runtime.rank() == 0:
            print("matex: resumed from the checkpoint in %s at epoch %d"
                  % (self.backup_dir, _compat.initial_epoch(self.model) + 1), flush=True)


_SUPPRESS = "_matex_no_restore"


def suppress_restore(model, suppressed):
    """Make backup callbacks of ``model`` restore nothing (``suppressed``) or as usual.

    ``fit`` sets it when it runs Keras's ``fit`` again after a recovery: the
    decision must be the same on every rank (it derives it from state the
    survivors just synchronised).
    """
    setattr(model, _SUPPRESS, bool(suppressed))


def restore(callback):
    """Restore a ``BackupAndRestore``'s backup as rank 0 sees it, on every rank.

    Whether a backup exists, and its epoch, are read on rank 0 and broadcast;
    the weights are read on rank 0 and broadcast (``load_weights``), and so is
    the optimizer's state, which the file holds too (step counter, moments):
    every rank goes on from the same state. Returns whether weights were
    restored.

    Inside a ``fit`` that recovered from a lost rank after training moved on
    (``suppress_restore``) nothing is restored: the survivors' state is newer
    than any checkpoint, and restoring would train committed epochs again.
    """
    if getattr(callback.model, _SUPPRESS, False):
        return False
    files = _compat.file_utils()
    paths = _compat.backup_paths(callback)
    state = None
    if _runtime.rank() == 0:
        epoch = None
        if files.exists(paths["meta"]):
            with files.File(paths["meta"], "r") as f:
                epoch = json.loads(f.read())["epoch"]
        state = (files.exists(paths["weights"]), epoch)
    has_weights, epoch = _runtime.control().bcast(state, root=0)
    model = callback.model
    if has_weights:
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(paths["weights"])   # read on rank 0, broadcast
        if model.optimizer is not None:
            # rank 0 read the optimizer's state from the file; load_weights
            # broadcasts the model's variables only
            _collectives.broadcast_variables(list(model.optimizer.variables), 0)
    if epoch is not None:
        _compat.set_initial_epoch(model, epoch)
    return has_weights


def restore_on_train_begin(callback, logs=None):
    """Keras ``BackupAndRestore.on_train_begin`` with rank 0's files deciding for all.

    As in Keras, unreadable weights fall back to the previous backup, if any.
    """
    files = _compat.file_utils()
    paths = _compat.backup_paths(callback)
    try:
        restore(callback)
    except OSError as exc:   # raised on every rank: load_weights shares rank 0's failure
        fallback = None
        if _runtime.rank() == 0 and files.exists(paths["prev_weights"]):
            files.copy(paths["prev_weights"], paths["weights"])
            if files.exists(paths["prev_meta"]):
                files.copy(paths["prev_meta"], paths["meta"])
            elif files.exists(paths["meta"]):
                files.remove(paths["meta"])
            fallback = True
        if not _runtime.control().bcast(fallback, root=0):
            raise exc
        restore(callback)
