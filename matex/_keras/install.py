"""The patch table: what ``import matex.keras`` / ``python -m matex`` change in Keras."""

import threading

from matex import _compat, _runtime, _state
from matex._keras import (batchnorm, checkpoint, fit, inference, metrics, optimizers, output,
                          randomness, strategies)
from matex._keras import calls

_lock = threading.Lock()
_now = _state.namespace("keras.install", "process", installed=False)


def patch(owner, name, wrapper):
    """A transparent patch: it stands down once the script uses an explicit layer."""
    calls.patch(owner, name, wrapper, stands_down=True)


def install():
    """Patch Keras so that every script using it trains distributed (idempotent)."""
    with _lock:
        if _now.installed:
            return
        import keras

        from matex import _optimizer, _resilience, _transparent

        _compat.warn_if_untested()
        _runtime.init()
        _transparent.seed_script_rngs()   # once; python -m matex did it before the script
        _resilience.install_excepthook(ulfm=True)
        _optimizer._patch_keras_trainer()
        trainer, tf_trainer = _compat.trainer_class(), _compat.tf_trainer_class()
        patch(trainer, "compile", optimizers.compile_wrapper)
        patch(trainer, "get_metrics_result", metrics.get_metrics_result)
        patch(tf_trainer, "fit", fit.fit)
        patch(tf_trainer, "evaluate", inference.evaluate)
        patch(tf_trainer, "predict", inference.predict)
        patch(tf_trainer, "train_on_batch", metrics.on_batch)
        patch(tf_trainer, "test_on_batch", metrics.on_batch)
        patch(tf_trainer, "train_step", optimizers.train_step_wrapper)
        patch(_compat.base_optimizer_class(), "apply", optimizers.apply_wrapper)
        variable = _compat.keras_variable_class()
        patch(variable, "__int__", strategies.scalar_wrapper(int))   # MirroredVariable values
        patch(variable, "__float__", strategies.scalar_wrapper(float))
        patch(keras.Model, "save_weights", output.rank0_write)
        patch(keras.Model, "load_weights", output.load_weights)
        backup = keras.callbacks.BackupAndRestore
        patch(backup, "on_train_begin", lambda original: checkpoint.restore_on_train_begin)
        patch(backup, "_save_model", output.rank0_write)   # whoever is rank 0 now writes
        patch(backup, "on_train_end", output.rank0_write)  # ... and deletes the backup
        saving = _compat.saving_api()
        original_save, original_load = saving.save_model, saving.load_model
        patch(saving, "save_model", output.rank0_write)
        patch(saving, "load_model", output.load_model)
        for namespace in _compat.saving_namespaces():
            if getattr(namespace, "save_model", None) is original_save:
                namespace.save_model = saving.save_model
            if getattr(namespace, "load_model", None) is original_load:
                namespace.load_model = saving.load_model
        batchnorm.install()    # BatchNormalization(synchronized=True) over the ranks
        randomness.install()   # dropout & co.: a stream per rank
        from matex.legacy._keras2 import refuse_transparent   # tf-keras: one clear error

        _transparent.after_import("tf_keras", refuse_transparent)
        _now.installed = True
