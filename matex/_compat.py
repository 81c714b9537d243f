"""Every private Keras and TensorFlow name MaTEx relies on, and nothing else.

MaTEx makes Keras distributed by patching a handful of Keras's own methods
and reading a few private attributes. All of them are reached through this
module, so a Keras upgrade that moves one fails ``check()`` (and the test
that calls it) with the name, instead of failing training somewhere deep.

Tested with Keras ``TESTED_KERAS`` (3.15 here) and TensorFlow 2.21; outside that
range ``warn_if_untested()`` says so once.
"""

import contextlib
import importlib
import warnings
from typing import Iterator

from matex import _state

TESTED_KERAS = ((3, 15), (3, 15))   # inclusive minor-version range tested
TESTED_TENSORFLOW = ((2, 21), (2, 21))
TESTED_KERAS_TUNER = ((1, 4), (1, 4))   # keras-tuner 1.4.8 tested (matex.hpo)
TESTED_TF_KERAS = ((2, 21), (2, 21))   # tf-keras 2.21.0 tested (Keras 2, matex.legacy._keras2)
MINIMUM_TENSORFLOW = (2, 21)   # older: `import matex` refuses (the ops use 2.21's API)
# Distributions that install the `tensorflow` module, most common first: MaTEx
# accepts any of them (setup.py requires none; extras [cpu] / [and-cuda] add one)
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-macos",
                            "tensorflow-intel", "intel-tensorflow", "tensorflow-rocm",
                            "tensorflow-aarch64", "tensorflow-cpu-aws", "tf-nightly",
                            "tf-nightly-cpu")
INSTALL_TENSORFLOW = ("pip install 'matex[cpu]' (tensorflow-cpu), 'matex[and-cuda]' "
                      "(tensorflow with CUDA), or your platform's TensorFlow build")

# (module, attribute path) of every private name used below; check() verifies each
REQUIRED = (
    ("keras.src.trainers.trainer", "Trainer.compile"),
    ("keras.src.trainers.trainer", "Trainer.get_metrics_result"),
    ("keras.src.trainers.trainer", "Trainer._symbolic_build"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.fit"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.evaluate"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.predict"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.train_step"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.make_train_function"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._make_function"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.apply"),
    ("keras.src.saving.saving_api", "save_model"),
    ("keras.src.saving.saving_api", "load_model"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split"),
    ("keras.src.utils.file_utils", "exists"),
    ("keras.src.utils.file_utils", "File"),
    ("keras.src.utils.file_utils", "copy"),
    ("keras.src.utils.file_utils", "remove"),
    ("keras.src.models.model", "Model._flatten_layers"),
    ("keras.src.trainers.trainer", "Trainer._flatten_metrics_in_order"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.train_on_batch"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.test_on_batch"),
    ("keras.src.callbacks.backup_and_restore", "BackupAndRestore._save_model"),
    ("keras.src.backend.tensorflow.nn", "_compute_moments_sync"),
    # the moments a BatchNormalization normalises with (hvd.SyncBatchNormalization's own)
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments"),
    ("keras.src.backend.common.global_state", "get_global_attribute"),
    ("keras.src.backend.common.variables", "Variable.__int__"),
    ("keras.src.backend.common.variables", "Variable.__float__"),
    ("tensorflow.python.distribute.distribute_lib", "_get_default_strategy"),
    ("tensorflow.python.client.session", "BaseSession.run"),   # matex.legacy's run hooks
    # streaming a whole model into one .keras file (keras_file_layout, weightless_build)
    ("keras.src.saving.saving_lib", "_save_state"),
    ("keras.src.saving.saving_lib", "_serialize_model_as_json"),
    ("keras.src.saving.saving_lib", "H5IOStore.__setitem__"),
    ("keras.src.saving.saving_lib", "DiskIOStore"),
    ("keras.src.saving.saving_lib", "_VARS_FNAME_H5"),
    ("keras.src.saving.saving_lib", "_CONFIG_FILENAME"),
    ("keras.src.saving.saving_lib", "_METADATA_FILENAME"),
    ("keras.src.saving.saving_lib", "_ASSETS_DIRNAME"),
    ("keras.src.backend.common.global_state", "set_global_attribute"),
    ("keras.src.utils.io_utils", "ask_to_proceed_with_overwrite"),
    # keras-tuner (matex.hpo): the tuner's search loop, the oracle's bookkeeping, its JSON writer
    ("keras_tuner.src.engine.base_tuner", "BaseTuner.__init__"),
    ("keras_tuner.src.engine.base_tuner", "BaseTuner.search"),
    ("keras_tuner.src.engine.base_tuner", "BaseTuner.save"),
    ("keras_tuner.src.engine.base_tuner", "BaseTuner.get_trial_dir"),
    ("keras_tuner.src.engine.base_tuner", "BaseTuner._run_and_update_trial"),
    ("keras_tuner.src.engine.oracle", "LOCKS"),
    ("keras_tuner.src.engine.oracle", "THREADS"),
    ("keras_tuner.src.engine.base_tuner", "BaseTuner.project_dir"),
    ("keras_tuner.src.engine.oracle", "Oracle._set_project_dir"),
    ("keras_tuner.src.engine.oracle", "Oracle._get_oracle_fname"),
    ("keras_tuner.src.engine.trial", "Trial.from_state"),
    ("keras_tuner.src.utils", "save_json"),
    # keras-tuner (matex.hpo's oracles): random points and the record of points tried
    ("keras_tuner.src.engine.oracle", "Oracle._random_values"),
    ("keras_tuner.src.engine.oracle", "Oracle._duplicate"),
    # node attributes on the ops a graph makes in a scope (matex.horovod's mismatch code)
    ("tensorflow.python.framework.ops", "Graph._attr_scope"),
    # a TF1 graph's v1 cond/while_loop being built (MaTEx collectives refuse to go there)
    ("tensorflow.python.framework.ops", "Graph._get_control_flow_context"),
    # control flow v2's cond in a TF1 graph (a v1 optimizer's reduction every N-th call)
    ("tensorflow.python.ops.cond_v2", "cond_v2"),
    # a bookkeeping variable made while a tf.function is traced again (bookkeeping_variable)
    ("tensorflow.python.ops.resource_variable_ops", "ResourceVariable"),
)

# private tf-keras names (Keras 2 under TF_USE_LEGACY_KERAS=1, matex.legacy._keras2); checked by
# check_tf_keras() where tf-keras is installed (the extra matex[tf-keras])
REQUIRED_TF_KERAS = (
    # Horovod's Keras 2 DistributedOptimizer reduces in the hook minimize() calls
    ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2._compute_gradients"),
    # slots made before the first step (hvd.elastic's KerasState)
    ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2._create_all_weights"),
    # Horovod's momentum correction: which legacy optimizers have a momentum hyperparameter
    ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2._set_hyper"),
    # what tf-keras's fit asks of a callback (MaTEx's Horovod callbacks provide it)
    ("tf_keras.src.callbacks", "Callback._implements_train_batch_hooks"),
    ("tf_keras.src.callbacks", "Callback._implements_test_batch_hooks"),
    ("tf_keras.src.callbacks", "Callback._implements_predict_batch_hooks"),
)

# private attributes of instances, set in __init__ (checked on a fresh instance by the test)
BACKUP_ATTRIBUTES = ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                     "_prev_training_metadata_path", "_current_epoch", "_last_batch_seen")
OPTIMIZER_ATTRIBUTES = ("_learning_rate", "_trainable_variables")
MODEL_ATTRIBUTES = ("_jit_compile", "_initial_epoch", "train_function")
# the tf.distribute strategy a model / optimizer was made under (matex._keras.strategies)
OPTIMIZER_ATTRIBUTES += ("_distribution_strategy",)
MODEL_ATTRIBUTES += ("_distribute_strategy",)
ORACLE_ATTRIBUTES = ("_retry_queue", "_run_times", "end_order", "ongoing_trials", "trials")
EVALUATE_CACHED_KEYWORD = "_use_cached_eval_dataset"   # fit -> evaluate: reuse the val iterator


def _resolve(module, path):
    value = importlib.import_module(module)
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _missing(required):
    """The ``module.path`` names of ``required`` that do not resolve."""
    missing = []
    for module, path in required:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append("%s.%s" % (module, path))
    return missing


def check():
    """Names in ``REQUIRED`` that this Keras lacks (empty when all is well)."""
    return _missing(REQUIRED)


def check_tf_keras():
    """Names in ``REQUIRED_TF_KERAS`` that this tf-keras lacks (empty when all is well)."""
    return _missing(REQUIRED_TF_KERAS)


def tf_keras_build_optimizer(optimizer, var_list):
    """Make a Keras 2 optimizer's slots for ``var_list`` (idempotent in both kinds)."""
    legacy = _resolve("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2")
    if isinstance(optimizer, legacy):
        optimizer._create_all_weights(var_list)
    else:
        optimizer.build(var_list)


def tf_keras_has_hyperparameter(optimizer, name):
    """Whether a tf-keras legacy optimizer (``OptimizerV2``) has hyperparameter ``name``."""
    legacy = _resolve("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2")
    return isinstance(optimizer, legacy) and name in optimizer._hyper


def tf_keras_training_entry_points():
    """(class, method name) of every tf-keras call that trains: refused by the transparent
    path on several ranks (matex.legacy._keras2.refuse_transparent)."""
    import tf_keras

    return [(tf_keras.Model, "fit"), (tf_keras.Model, "train_on_batch"),
            (tf_keras.optimizers.Optimizer, "apply_gradients"),
            (tf_keras.optimizers.legacy.Optimizer, "apply_gradients")]


def _version(module):
    return tuple(int(p) for p in module.__version__.split(".")[:2] if p.isdigit())


def _release(text):
    """(major, minor) of a version string such as "2.21.0" or "2.22.0rc1"."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:2]]
    return tuple(parts + [0] * (2 - len(parts)))


def tensorflow_distributions() -> list[tuple[str, str]]:
    """``[(distribution, version)]`` of the installed packages providing ``tensorflow``.

    Read from the installed metadata without importing TensorFlow (seconds):
    the known names first, then every installed distribution when none of
    those is present (a vendor build under another name).
    """
    from importlib import metadata

    found = []
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    if not found:
        for name in sorted(set(metadata.packages_distributions().get("tensorflow", ()))):
            try:
                found.append((name, metadata.version(name)))
            except metadata.PackageNotFoundError:
                continue
    return found


def require_tensorflow() -> None:
    """Raise ImportError naming the fix if no TensorFlow, or one older than 2.21, is installed.

    setup.py requires no TensorFlow distribution (pip would force one flavour
    beside the one a cluster has), so ``import matex`` checks instead.
    """
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        raise ImportError("MaTEx needs TensorFlow >= %d.%d, and none is installed: %s"
                          % (MINIMUM_TENSORFLOW + (INSTALL_TENSORFLOW,)))
    for name, version in tensorflow_distributions():
        if _release(version) < MINIMUM_TENSORFLOW:
            raise ImportError("MaTEx needs TensorFlow >= %d.%d, this is %s %s: upgrade it "
                              "(pip install -U %s)"
                              % (MINIMUM_TENSORFLOW + (name, version, name)))


def require_extra(modules: tuple[str, ...], extra: str, what: str) -> None:
    """Raise ImportError naming ``pip install 'matex[extra]'`` if one of ``modules`` is missing.

    Optional features (Keras Tuner, scipy, matplotlib) are extras, not
    requirements: the part of MaTEx that needs one says which extra adds it.
    """
    import importlib.util

    missing = []
    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                missing.append(module)
        except (ImportError, ValueError):   # blocked (sys.modules[name] = None) or broken
            missing.append(module)
    if missing:
        raise ImportError("%s needs %s, not installed: pip install 'matex[%s]'"
                          % (what, " and ".join(missing), extra))


_now = _state.namespace("compat", "process", warned=False)


def warn_if_untested():
    """Warn once if Keras or TensorFlow is outside the versions MaTEx was tested with."""
    if _now.warned:
        return
    _now.warned = True
    import keras
    import tensorflow as tf

    for name, module, (low, high) in (("Keras", keras, TESTED_KERAS),
                                      ("TensorFlow", tf, TESTED_TENSORFLOW)):
        if not low <= _version(module) <= high:
            warnings.warn(
                "MaTEx was tested with %s %d.%d-%d.%d, this is %s: distributed training may "
                "break where MaTEx patches %s internals (run tests/test_compat.py)"
                % (name, low[0], low[1], high[0], high[1], module.__version__, name),
                RuntimeWarning, stacklevel=2)


# ---- the classes MaTEx patches ------------------------------------------------------------

def trainer_class():
    """Keras's backend-independent ``Trainer`` (compile, get_metrics_result)."""
    return _resolve("keras.src.trainers.trainer", "Trainer")


def tf_trainer_class():
    """Keras's TensorFlow ``Trainer`` (fit, evaluate, predict, train_step)."""
    return _resolve("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")


def keras_variable_class():
    """Keras's backend-independent ``Variable`` (its ``__int__``/``__float__``)."""
    return _resolve("keras.src.backend.common.variables", "Variable")


def tf1_base_session_class():
    """TensorFlow's ``BaseSession``: ``Session`` and ``InteractiveSession`` run through it."""
    return _resolve("tensorflow.python.client.session", "BaseSession")


def base_optimizer_class():
    return _resolve("keras.src.optimizers.base_optimizer", "BaseOptimizer")


def saving_api():
    """The module whose ``save_model``/``load_model`` every public alias points to."""
    return importlib.import_module("keras.src.saving.saving_api")


def saving_namespaces():
    """Public modules re-exporting ``save_model``/``load_model`` (keras and tf.keras)."""
    import keras

    namespaces = [keras.saving, keras.models]
    for name in ("keras._tf_keras.keras.saving", "keras._tf_keras.keras.models"):
        try:
            namespaces.append(importlib.import_module(name))
        except ImportError:
            pass
    return namespaces


# ---- private helpers and attributes ---------------------------------------------------------

def bookkeeping_variable(make_value, name):
    """An eager, non-trainable variable for MaTEx's own counters, made even while a
    ``tf.function`` is traced again.

    ``tf.Variable`` there raises "Creating variables on a non-first call" (the
    function's variable creator refuses), although MaTEx makes each such variable
    once per process and keeps it: a step traced first without MaTEx's reduction and
    then with it (Horovod's elastic example does) would fail. The class constructed
    directly skips the creators; ``tf.init_scope`` makes it, and ``make_value()`` its
    initial value, outside the graph.
    """
    from tensorflow.python.ops import resource_variable_ops

    import tensorflow as tf

    with tf.init_scope():
        return resource_variable_ops.ResourceVariable(make_value(), trainable=False, name=name)


def train_validation_split(arrays, validation_split):
    """Keras's own split of array inputs into training and validation parts."""
    split = _resolve("keras.src.trainers.data_adapters.array_slicing", "train_validation_split")
    return split(arrays, validation_split=validation_split)


def file_utils():
    """Keras's file helpers (local and remote paths alike)."""
    return importlib.import_module("keras.src.utils.file_utils")


def flatten_layers(model):
    """Every layer inside ``model``, nested ones included."""
    return model._flatten_layers()


def flatten_metrics_in_order(model, logs):
    """``logs`` as the list ``train_on_batch``/``test_on_batch`` return without return_dict."""
    return model._flatten_metrics_in_order(logs)


def symbolic_build(model, data_batch):
    """Create ``model``'s variables (and its metrics' and loss's) from ``data_batch``'s
    shapes, eagerly, as Keras does before ``fit`` under a distribution strategy."""
    model._symbolic_build(data_batch=data_batch)


def forget_train_function(model):
    """Make ``fit`` trace its train step anew (a fresh ``tf.function``)."""
    model.train_function = None


def forget_step_functions(model):
    """Make ``fit``/``evaluate`` trace their steps anew."""
    forget_train_function(model)
    model.test_function = None


def set_initial_epoch(model, epoch):
    """The epoch ``fit`` resumes at (what ``BackupAndRestore`` sets)."""
    model._initial_epoch = epoch


def initial_epoch(model):
    return model._initial_epoch


def backup_paths(callback):
    """A ``BackupAndRestore``'s file paths: weights, metadata and their previous versions."""
    return {"weights": callback._weights_path, "meta": callback._training_metadata_path,
            "prev_weights": callback._prev_weights_path,
            "prev_meta": callback._prev_training_metadata_path}


def backup_position(callback):
    """(epoch, batch) a ``BackupAndRestore`` records in its metadata."""
    return callback._current_epoch, callback._last_batch_seen


def disable_backup_writes(callback):
    """Make a ``BackupAndRestore`` write nothing (it still restores)."""
    callback._save_model = lambda *a, **k: None
    callback.on_train_end = lambda logs=None: None


MOMENTS_SYNC_NAME = "_compute_moments_sync"   # what moments(..., synchronized=True) calls
MOMENTS_NAME = "_compute_moments"             # what moments(..., synchronized=False) calls


BATCHNORM_MOMENTS = "_moments"   # BatchNormalization's (inputs, mask) -> (mean, variance)


def batchnorm_reduction_axes(layer) -> list:
    """The axes a built ``BatchNormalization`` reduces over (all but its ``axis``)."""
    return list(layer._reduction_axes)


def keras_tf_nn():
    """Keras's TensorFlow backend ``nn`` module (whose synchronised moments MaTEx replaces)."""
    return importlib.import_module("keras.src.backend.tensorflow.nn")


def in_layer_call():
    """Whether a Keras ``Layer.__call__`` is running in this thread (its call context)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("current_call_ctx") is not None


def learning_rate_object(optimizer):
    """The optimizer's learning rate as given: a variable or a ``LearningRateSchedule``."""
    return getattr(optimizer, "_learning_rate", None)


def optimizer_trainable_variables(optimizer):
    """The variables a built optimizer tracks."""
    return optimizer._trainable_variables


def jit_compile(model):
    return model._jit_compile


def _non_default(strategy):
    default = _resolve("tensorflow.python.distribute.distribute_lib", "_get_default_strategy")()
    return None if strategy is None or strategy is default else strategy


def model_strategy(model):
    """The ``tf.distribute`` strategy whose scope built ``model``; None for none (the default)."""
    return _non_default(getattr(model, "_distribute_strategy", None))


def optimizer_strategy(optimizer):
    """The ``tf.distribute`` strategy in scope when ``optimizer`` was made; None for none."""
    return _non_default(getattr(optimizer, "_distribution_strategy", None))


def set_jit_compile(model, value):
    model._jit_compile = value


def make_function(model, step):
    """Keras's wrapper turning a one-batch ``step`` into ``fit``'s train function."""
    return model._make_function(step)


# ---- keras-tuner (matex.hpo) ---------------------------------------------------------------

# BaseTuner's method that runs one trial's body and reports its results (it raises;
# its caller turns an error into a failed trial)
TUNER_RUN_TRIAL = "_run_and_update_trial"


def base_tuner_class():
    """Keras Tuner's ``BaseTuner``: every tuner's ``__init__``, ``search`` and files."""
    return _resolve("keras_tuner.src.engine.base_tuner", "BaseTuner")


def kt_utils():
    """The module whose ``save_json`` writes every oracle, trial and tuner file."""
    return importlib.import_module("keras_tuner.src.utils")


def set_oracle_project_dir(oracle, directory, project_name):
    """Point an oracle at its project directory (what ``BaseTuner.__init__`` does)."""
    oracle._set_project_dir(directory, project_name)


def oracle_retry_queue(oracle):
    """Ids of the trials an oracle will hand out again before new ones (a list)."""
    return oracle._retry_queue


def oracle_reload_from_disk(oracle):
    """Reload an oracle from its project directory; ``{tuner id: trial id}`` it had running.

    Keras Tuner's ``reload`` sends every trial that was running to the retry
    queue and forgets which tuner ran it; the mapping is read from the same
    ``oracle.json`` first, so a caller can give a trial back to the tuner still
    running it (matex.hpo's takeover after the oracle's owner died).
    """
    import json

    with open(oracle._get_oracle_fname()) as f:
        running = dict(json.load(f).get("ongoing_trials", {}))
    oracle.reload()
    return running


def oracle_unlock_after_error(oracle):
    """Release an oracle's lock that Keras Tuner's ``@synchronized`` left held by a raise.

    Its wrapper releases the lock only when the call returns: after an error
    (e.g. too many failed trials in a row) the lock stays held and the next
    call from another thread waits for ever. Released only when this thread
    holds it.
    """
    import threading

    module = importlib.import_module("keras_tuner.src.engine.oracle")
    if oracle in module.THREADS and module.THREADS[oracle] == threading.current_thread().name:
        module.THREADS[oracle] = None
        module.LOCKS[oracle].release()


def oracle_run_times(oracle):
    """How many times each trial id has run (a defaultdict)."""
    return oracle._run_times


def oracle_random_values(oracle):
    """A random point of the oracle's space (active hyperparameters only), one not tried yet.

    Keras Tuner's own sampler (it advances the oracle's saved seed, so a resumed
    search draws what an uninterrupted one would); None when it keeps colliding.
    """
    return oracle._random_values()


def oracle_has_tried(oracle, values):
    """Whether the oracle has already handed out (or run) these hyperparameter values."""
    return oracle._duplicate(values)


# ---- matex.parallel (pipelines) ---------------------------------------------

def inbound_nodes(layer):
    """The calls of ``layer`` recorded in functional graphs (a shared layer has several)."""
    return list(getattr(layer, "_inbound_nodes", ()) or ())


def loss_tracker(model):
    """The ``Mean`` metric a Keras train step feeds its loss to (``logs["loss"]``)."""
    return model._loss_tracker


def tf_random_seed_module():
    """TensorFlow's ``random_seed`` module: its ``get_seed`` gives every stateful random op
    (``tf.random.normal``, ``tf.nn.dropout``, ...) its seeds when the op is created."""
    return importlib.import_module("tensorflow.python.framework.random_seed")


# ---- one .keras file written as a model's weights arrive (matex.parallel.save_model) -------
# Tested with Keras 3.15: a variable created inside a StatelessScope from a callable
# initializer is lazy (shape and dtype, no value; Keras lists it in the global
# "uninitialized_variables" and initialises it when the outermost scope exits), and
# saving_lib writes a .keras zip as metadata.json, config.json and model.weights.h5 (a
# "vars" group per saveable holding datasets "0", "1", ... from save_own_variables).


@contextlib.contextmanager
def weightless_build() -> Iterator[None]:
    """Keras variables created inside have shape and dtype but no value: no memory.

    Keras 3 makes a variable lazy when it is created in a ``StatelessScope`` from
    an initializer; the scope's own initialisation on exit is skipped, and the
    variables are taken off Keras's list of ones to initialise later, so nothing
    fills them. Reading one gives a fresh draw of its initializer: build a model
    here only for its structure and its variables' shapes (``keras_file_layout``).
    """
    import keras
    from keras.src.backend.common import global_state

    key = "uninitialized_variables"
    before = list(global_state.get_global_attribute(key, [], set_to_default=True))
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute(key, before)


def keras_file_layout(model, archive, h5_path: str) -> tuple:
    """Write ``model``'s ``.keras`` file, all but its weight values, as ``model.save`` would.

    ``archive``: an open ``zipfile.ZipFile`` (mode "w"): gets ``metadata.json``,
    ``config.json`` and any assets exactly as Keras writes them. The weights' HDF5
    file is made at ``h5_path`` by Keras's own saving walk, each variable's dataset
    created with its shape and dtype but not written (the model may be built
    weightless, ``weightless_build``). Returns ``(h5_file, [(variable, dataset)],
    member)``: fill the datasets, close ``h5_file``, then add ``h5_path`` to the
    archive as ``member``. Arrays saved outside the model's layers (a compiled
    model's optimizer saves its variables as numpy) are written at once; a layer
    that saves a computed value instead of its variable (a LoRA-merged kernel, a
    quantized one) is refused (ValueError).
    """
    import numpy as np
    from keras.src.saving import saving_lib

    variable_class = keras_variable_class()

    class LayoutStore(saving_lib.H5IOStore):
        """Keras's H5 store, creating each variable's dataset empty and recording it."""

        datasets: list

        def __setitem__(self, key, value):
            path = self._h5_entry_path or ""
            if isinstance(value, (np.ndarray, np.generic)) and not path.startswith("layers"):
                # a value saved outside the (weightless) layers, e.g. the optimizer's own
                # variables as numpy: written now, as Keras writes it
                return super().__setitem__(key, value)
            if not self._h5_entry_initialized:
                self._create_h5_group(self._h5_entry_path)
            if not isinstance(value, variable_class):
                raise ValueError(
                    "the layer at %r saves a computed value under %r, not a variable, so "
                    "its file cannot be written as its weights arrive"
                    % (self._h5_entry_path or "/", key))
            dtype = value.dtype
            if dtype == "bfloat16":
                import ml_dtypes
                dataset = self._h5_entry_group.create_dataset(
                    key, shape=tuple(value.shape), dtype=ml_dtypes.bfloat16)
                dataset.attrs["dtype"] = "bfloat16"
            else:
                dataset = self._h5_entry_group.create_dataset(
                    key, shape=tuple(value.shape), dtype=np.dtype(dtype))
            self.datasets.append((value, dataset))

    config_json, metadata_json = saving_lib._serialize_model_as_json(model)
    with archive.open(saving_lib._METADATA_FILENAME, "w") as f:
        f.write(metadata_json.encode())
    with archive.open(saving_lib._CONFIG_FILENAME, "w") as f:
        f.write(config_json.encode())
    store = LayoutStore(h5_path, mode="w")
    store.datasets = []
    assets = saving_lib.DiskIOStore(saving_lib._ASSETS_DIRNAME, archive=archive, mode="w")
    try:
        saving_lib._save_state(model, weights_store=store, assets_store=assets,
                               inner_path="", visited_saveables=set())
    except BaseException:
        store.close()
        raise
    finally:
        assets.close()
    return store.h5_file, store.datasets, saving_lib._VARS_FNAME_H5


def ask_to_overwrite(filepath: str) -> bool:
    """Keras's own prompt before ``model.save(..., overwrite=False)`` replaces a file."""
    return _resolve("keras.src.utils.io_utils", "ask_to_proceed_with_overwrite")(filepath)


def graph_attr_scope(graph, attrs):
    """``graph._attr_scope(attrs)``: ops created in it get these node attributes.

    ``attrs`` maps names to ``AttrValue`` protos, or to callables of the new
    op's ``NodeDef`` returning one or None (no attribute on that op).
    """
    return graph._attr_scope(attrs)


def cond_v2(pred, true_fn, false_fn):
    """Control flow v2's ``cond`` (an ``If`` op over two functions), also in a TF1 graph."""
    from tensorflow.python.ops import cond_v2 as module

    return module.cond_v2(pred, true_fn, false_fn)


def tf1_control_flow_context(graph):
    """The v1 ``cond``/``while_loop`` context ops made now in ``graph`` go into (None: none)."""
    return graph._get_control_flow_context()
