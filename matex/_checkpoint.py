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
        self._load_model()

    def _load_model(self):
        state = None
        if _runtime.rank() == 0 and os.path.exists(self._weights_path):
            with open(self._training_metadata_path) as f:
                state = json.load(f)["epoch"]
        epoch = _runtime.comm().bcast(state, root=0)
        if epoch is None:
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self.model.load_weights(self._weights_path)   # read on rank 0, broadcast
        self.model._initial_epoch = epoch
        if _runtime.rank() == 0:
            print("matex: resumed from the checkpoint in %s at epoch %d"
                  % (self.backup_dir, epoch + 1), flush=True)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and _runtime.rank() == 0:
            super().on_train_end(logs)
