"""Checkpoints that are never half-written, for restart after a failure.

``AtomicBackupAndRestore`` is Keras's ``BackupAndRestore`` with two changes:
files are written under a temporary name and renamed into place (a rank dying
mid-write leaves the previous checkpoint intact), and whether a checkpoint
exists is decided on rank 0 and broadcast, so all ranks restore the same state
even when their view of the file system differs. ``fit`` adds it by itself
when ``MATEX_CHECKPOINT_DIR`` is set (``matexrun --restart``).
"""

import json
import os

import keras

from matex import _faults, _runtime


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """Back up weights and epoch every epoch; resume from them at the next ``fit``."""

    def _save_model(self):
        if _runtime.rank() != 0:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        weights_tmp = os.path.join(self.backup_dir, "incoming.weights.h5")
        meta_tmp = self._training_metadata_path + ".incoming"
        self.model.save_weights(filepath=weights_tmp, overwrite=True)
        with open(meta_tmp, "w") as f:
            json.dump({"epoch": self._current_epoch, "batch": self._last_batch_seen}, f)
            f.flush()
            os.fsync(f.fileno())
        _faults.maybe_fail(int(self.model.optimizer.iterations), "checkpoint")
        os.replace(weights_tmp, self._weights_path)
        os.replace(meta_tmp, self._training_metadata_path)

    def on_train_begin(self, logs=None):
        if restore(self) and _runtime.rank() == 0:
            print("matex: resumed from the checkpoint in %s at epoch %d"
                  % (self.backup_dir, self.model._initial_epoch + 1), flush=True)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and _runtime.rank() == 0:
            super().on_train_end(logs)


def restore(callback):
    """Restore a ``BackupAndRestore``'s backup as rank 0 sees it, on every rank.

    Whether a backup exists, and its epoch, are read on rank 0 and broadcast;
    the weights are read on rank 0 and broadcast (``load_weights``). Returns
    whether weights were restored.
    """
    from keras.src.utils import file_utils

    state = None
    if _runtime.rank() == 0:
        epoch = None
        if file_utils.exists(callback._training_metadata_path):
            with file_utils.File(callback._training_metadata_path, "r") as f:
                epoch = json.loads(f.read())["epoch"]
        state = (file_utils.exists(callback._weights_path), epoch)
    has_weights, epoch = _runtime.comm().bcast(state, root=0)
    model = callback.model
    if has_weights:
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(callback._weights_path)   # read on rank 0, broadcast
    if epoch is not None:
        model._initial_epoch = epoch
    return has_weights


def restore_on_train_begin(callback, logs=None):
    """Keras ``BackupAndRestore.on_train_begin`` with rank 0's files deciding for all.

    As in Keras, unreadable weights fall back to the previous backup, if any.
    """
    from keras.src.utils import file_utils

    try:
        restore(callback)
    except OSError as exc:   # raised on every rank: load_weights shares rank 0's failure
        fallback = None
        if _runtime.rank() == 0 and file_utils.exists(callback._prev_weights_path):
            file_utils.copy(callback._prev_weights_path, callback._weights_path)
            if file_utils.exists(callback._prev_training_metadata_path):
                file_utils.copy(callback._prev_training_metadata_path,
                                callback._training_metadata_path)
            elif file_utils.exists(callback._training_metadata_path):
                file_utils.remove(callback._training_metadata_path)
            fallback = True
        if not _runtime.comm().bcast(fallback, root=0):
            raise exc
        restore(callback)
