"""``PipelineModel``: a Keras model whose stages live on different ranks.

    pm = matex.parallel.PipelineModel(model, microbatches=4, schedule="1f1b")
    pm.compile(optimizer="adam", loss="mse")
    pm.fit(x, y, batch_size=64)          # on every rank, with the same data

Every rank of the pipeline builds the same model and keeps one stage of it
(``_stages`` says where the stages begin): ``pm.trainable_weights`` are this
rank's stage. A training step splits the (data replica's share of the)
global batch into M equal micro-batches and runs them through the stages in
the order of the schedule (``_schedule``): forward activations go to the next
stage and gradients back with ``matex.parallel.send``/``recv``/``sendrecv``
inside the step's ``tf.function``. Each stage sums its micro-batches'
gradients (the loss of micro-batch m counts 1/M), so one step equals one
unpipelined step on the whole batch, up to float rounding. With a grid of
data x pipeline ranks, the summed gradients are then averaged over the data
communicator (slot 0) and every stage's optimizer applies them.

Loss and metrics are computed on the last stage; ``get_metrics_result``
broadcasts their states from the last stage over the pipeline and sums them
over the data replicas, so every rank reports the same, exact global logs.

Requirements (each a ValueError on every rank): the micro-batch count M
divides every batch's rows (per data replica: D x M divides the global
batch); the stages equal the pipeline ranks; each cut separates the graph.
``predict`` accepts any number of rows (it pads internally).

Three modules, one concept each: this one is the Keras model (stages, data,
``fit``/``evaluate``/``predict``, gathering and saving the whole model);
``_execution`` runs the steps; ``_checkpoints`` writes and reads checkpoints.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import keras
import tensorflow as tf

from matex import _batch_slicing, _collectives, _runtime
from matex._everywhere import RemoteError, on_every_rank
from matex.parallel import _schedule, _stages
from matex.parallel._checkpoints import PipelineCheckpoints
from matex.parallel._execution import PipelineExecution, _agreed, _Layout
from matex.parallel._stages import StageBoundary

if TYPE_CHECKING:
    from matex.parallel._grid import Grid


def _own_copy(shared):
    """A copy of the stage model ``shared`` made of new layers holding copies of its weights.

    ``shared`` is built on the whole model's graph: its layers stay linked to every
    other stage's layers (and their weights) through the graph's nodes. The copy
    is linked to nothing else, so once the caller drops the whole model, a rank
    holds only its own stage's weights. A layer that cannot be re-created from its
    config keeps the shared stage (with a warning: the whole model stays alive).
    """
    from matex.parallel import _tensor

    def fresh(layer):
        copy = layer.__class__.from_config(layer.get_config())
        if isinstance(layer, _tensor._TensorParallel):
            # the same tensor group as the original (not whatever grid is open now)
            copy._slot, copy.tensor_size, copy.tensor_rank = (
                layer._slot, layer.tensor_size, layer.tensor_rank)
        return copy

    try:
        stage = keras.models.clone_model(shared, clone_function=fresh)
        for layer in stage.layers:
            if layer.weights:
                layer.set_weights(shared.get_layer(layer.name).get_weights())
    except Exception as exc:  # noqa: BLE001 - a custom layer's config; keep the shared stage
        import logging

        logging.getLogger("matex").warning(
            "matex.parallel: cannot copy stage %s from its layers' configs (%s: %s); this "
            "rank keeps the whole model's weights alive", shared.name, type(exc).__name__, exc)
        return shared
    return stage


def _weightless_config(model):
    """``model``'s serialized config as plain Keras: ``StageBoundary`` layers become
    ``Identity``, tensor-parallel layers the ``Dense`` / ``Conv2D`` they split (their
    whole sizes), no compile settings. Deserializing it gives the whole model with
    fresh weights; keeping it holds no weights."""
    from matex.parallel import _tensor

    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    plain = {}
    for layer in model.layers:
        if isinstance(layer, StageBoundary):
            plain[layer.name] = keras.layers.Identity(name=layer.name)
        elif isinstance(layer, _tensor._TensorParallel):
            cls, layer_config = _tensor._plain_config(layer)
            plain[layer.name] = cls.from_config(layer_config)
    for entry in config["config"]["layers"]:
        name = entry.get("config", {}).get("name")
        if name in plain:
            entry.update({key: value for key, value in
                          keras.saving.serialize_keras_object(plain[name]).items()
                          if key in ("module", "class_name", "config", "registered_name")})
            # built for a shard's (or no) shape; built again from the graph's shapes
            entry.pop("build_config", None)
    return config


def _nbytes(variables):
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))


def _split_off_validation(data, split):
    """(training part, validation part) of packed arrays: the last ``split`` of the rows,
    as Keras's ``validation_split`` takes them."""
    import math

    n = int(keras.tree.flatten(data)[0].shape[0])
    at = int(math.floor(n * (1.0 - split)))
    if at in (0, n):
        raise ValueError("matex.parallel: fit: %d rows cannot be split into training and "
                         "validation parts with validation_split=%r" % (n, split))
    return (keras.tree.map_structure(lambda t: None if t is None else t[:at], data),
            keras.tree.map_structure(lambda t: None if t is None else t[at:], data))


class _SharedOrder:
    """Batches of in-memory arrays, rows in one permutation per epoch given by ``seed``.

    Each pass over ``dataset()`` is the next epoch; the permutation of epoch e
    is ``default_rng([seed, e])``'s, so ranks holding the same seed feed the
    same rows, in the same order, every epoch.
    """

    def __init__(self, data, batch_size, seed):
        self.data = keras.tree.map_structure(lambda t: None if t is None else np.asarray(t),
                                             data)
        self.rows = int(keras.tree.flatten(self.data)[0].shape[0])
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0

    def _batches(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.rows)
        self.epoch += 1
        for start in range(0, self.rows, self.batch_size):
            rows = order[start:start + self.batch_size]
            yield keras.tree.map_structure(lambda a: a[rows], self.data)

    def dataset(self):
        spec = keras.tree.map_structure(
            lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)), self.data)
        steps = -(-self.rows // self.batch_size)
        ds = tf.data.Dataset.from_generator(self._batches, output_signature=spec)
        return ds.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)


def _lost_since_launch() -> list:
    """World ranks launched but not in MaTEx's communicator (lost at start-up, ULFM)."""
    from mpi4py import MPI

    comm = _runtime.comm()
    world = MPI.COMM_WORLD
    if comm.Get_size() == world.Get_size():
        return []
    kept = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                     world.Get_group())
    return sorted(set(range(world.Get_size())) - set(kept))


class PipelineModel(PipelineExecution, PipelineCheckpoints, keras.Model):
    """A Keras model split into pipeline stages, one per pipeline rank.

    Args:
      model: a built functional or Sequential model (the same on every rank),
        or an unbuilt Sequential (then call ``pm.build(input_shape)``: only
        this rank's layers are built, so no rank ever holds the whole model).
      microbatches: M, how many micro-batches a (per-replica) batch is cut
        into; it must divide every batch's rows.
      schedule: "1f1b" (default; one-forward-one-backward, at most P - p
        micro-batches' activations alive on stage p) or "gpipe" (all
        forwards, then all backwards).
      grid: a ``matex.parallel.grid(data=D, pipeline=P, tensor=T)``; default
        the open grid, else one pipeline over every rank of ``matex.comm()``.
      stages: where the stages begin: None (the model's ``StageBoundary``
        layers), a list of the names of the first layer of each stage after
        the first, or the number of stages (balanced by MaTEx).

    ``fit``, ``evaluate``, ``predict`` run on every rank with the same data
    and return the same results everywhere; ``save`` writes one plain Keras
    file holding every stage, tensor-parallel shards gathered (rank 0
    writes); ``save_checkpoint`` / ``restore_checkpoint`` carry weights and
    optimizer state to a grid with another data size.
    """

    def __init__(self, model: keras.Model, microbatches: int = 1, schedule: str = "1f1b",
                 grid: Grid | None = None, stages: list[str] | int | None = None,
                 name: str | None = None) -> None:
        super().__init__(name=name or "%s_pipeline" % model.name)
        # a stage lost while the pipeline is set up ends it as one lost in training does
        self._refusing_recovery(lambda: self._construct(model, microbatches, schedule, grid,
                                                        stages))

    def _construct(self, model, microbatches, schedule, grid, stages):
        layout = _Layout(grid)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_full", model)   # structure only (not tracked)

        def check():
            if not isinstance(microbatches, (int, np.integer)) or isinstance(microbatches, bool) \
                    or microbatches < 1:
                raise ValueError("matex.parallel: microbatches must be a positive integer, "
                                 "not %r" % (microbatches,))
            if schedule not in _schedule.SCHEDULES:
                raise ValueError("matex.parallel: schedule must be one of %s, not %r"
                                 % (", ".join(_schedule.SCHEDULES), schedule))

        def prepare():
            check()
            return _stages.plan(model, stages, layout.pipeline_size, agree=None)

        try:
            if isinstance(stages, (int, np.integer)) and not isinstance(stages, bool):
                # balancing measures time: rank 0 decides, everyone follows
                _agreed(layout.control, check)
                plan = _stages.plan(model, stages, layout.pipeline_size, agree=layout.control)
            else:
                plan = _agreed(layout.control, prepare)
        except ValueError as exc:
            lost = _lost_since_launch()
            if not lost:
                raise
            from matex.errors import RankFailure

            # a model written for the ranks launched, some lost before the first collective
            raise RankFailure(
                "matex.parallel: rank(s) %s of this pipeline failed as the job started, and "
                "the pipeline cannot be laid out on the %d left (%s). Relaunch it (matexrun "
                "--ft relaunches a job whose rank died while MPI started)."
                % (", ".join(map(str, lost)), layout.pipeline_size, exc)) from exc
        self.microbatches = int(microbatches)
        self.schedule = schedule
        self.plan = plan
        self._skip_results = False
        self._synced = False
        self._input_shape = None
        self.stage = None
        # the whole model's structure, without weights: what gather_model rebuilds
        try:
            whole_config = _weightless_config(model)
        except Exception as exc:  # noqa: BLE001 - only gather_model/save need it
            whole_config = exc
        object.__setattr__(self, "_whole_config", whole_config)
        if plan.built:
            self.stage = self._stage_of_graph(model, plan)
            self._learn_output_specs()
            self.built = True
            # keep no reference to the whole model: the stage holds its own copies of
            # this rank's layers, so the other stages' weights can be freed
            object.__setattr__(self, "_full", None)
        self._matex_explicit = True   # matex.keras leaves data and optimizer to us

    # ---- stages --------------------------------------------------------------

    def _stage_of_graph(self, model, plan):
        k, P = self._layout.pipeline_rank, plan.size
        if k == 0:
            inputs = model.inputs[0] if len(model.inputs) == 1 else list(model.inputs)
        else:
            inputs = model.get_layer(plan.starts[k]).input
        if k == P - 1:
            outputs = model.outputs[0] if len(model.outputs) == 1 else list(model.outputs)
        else:
            outputs = model.get_layer(plan.starts[k + 1]).input
        shared = keras.Model(inputs, outputs, name="%s_stage%d" % (model.name, k))
        return _own_copy(shared)

    def build(self, input_shape: tuple) -> None:
        """Build an unbuilt Sequential's stage for inputs of ``input_shape`` (this rank only)."""
        if self.stage is not None:
            self.built = True
            return
        shape = tuple(input_shape)
        self._input_shape = shape
        k = self._layout.pipeline_rank
        names = [n for group in self.plan.stage_layers[:k] for n in group]
        for n in names:
            layer = self._full.get_layer(n)
            try:
                shape = tuple(layer.compute_output_shape(shape))
            except NotImplementedError:
                raise ValueError(
                    "matex.parallel: cannot infer the output shape of layer %r without "
                    "building it; build the whole model instead" % n) from None
        layers = [self._full.get_layer(n) for n in self.plan.stage_layers[k]]
        self.stage = keras.Sequential([keras.Input(batch_shape=shape)] + layers,
                                      name="%s_stage%d" % (self._full.name, k))
        self._learn_output_specs()
        self.built = True

    def _stage_input_spec(self):
        t = self.stage.inputs[0]
        return list(t.shape[1:]), t.dtype

    def _learn_output_specs(self):
        """[(shape without batch, dtype)] of the whole model's outputs (collective when
        the model was an unbuilt Sequential: the last stage tells everyone)."""
        if self.plan.built:
            outs = self._full.outputs
            self._out_specs = [(list(t.shape[1:]), t.dtype) for t in outs]
            return
        spec = None
        if self._layout.last:
            spec = [(list(t.shape[1:]), t.dtype.name if hasattr(t.dtype, "name")
                     else str(t.dtype)) for t in self.stage.outputs]
        self._out_specs = self._layout.control.bcast(spec, root=self._last_world_rank())

    def _last_world_rank(self):
        g = self._layout.grid
        if g is None:
            return self._layout.pipeline_size - 1
        # the same root on every rank (the last stage's first data replica and tensor shard)
        return g.world_rank_of(data=0, pipeline=self._layout.pipeline_size - 1, tensor=0)

    def call(self, inputs: tf.Tensor, training: bool = False) -> tf.Tensor:
        rows = tf.shape(keras.tree.flatten(inputs)[0])[0]
        return self._forward_all(inputs, rows, training)

    # ---- compile / fit / evaluate / predict ------------------------------------

    def compile(self, *args: Any, **kwargs: Any) -> None:
        kwargs["jit_compile"] = False   # the p2p ops have no XLA kernels
        super().compile(*args, **kwargs)
        self._matex_explicit = True
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            # this model averages over the data replicas itself (slot 0 may span stages)
            object.__setattr__(optimizer, "_matex_reduced_by_wrapper", True)

    def _require_built(self):
        if self.stage is None:
            raise ValueError("matex.parallel: this PipelineModel wraps an unbuilt Sequential: "
                             "call pm.build(input_shape) first (on every rank)")

    def _check_array_batches(self, x, batch_size, what):
        """For array inputs: every batch (the last included) must split into D x M parts."""
        flat = keras.tree.flatten(x) if x is not None else []
        if not flat or not hasattr(flat[0], "shape") or isinstance(flat[0], tf.data.Dataset):
            return
        n = int(flat[0].shape[0])
        batch = batch_size or 32
        parts = self.microbatches * self._layout.data_size
        sizes = {min(batch, n)} | ({n % batch} if n % batch and n > batch else set())
        bad = sorted(s for s in sizes if s % parts)
        if bad:
            raise ValueError(
                "matex.parallel: %s: a batch of %d rows cannot be cut into %d data replica(s) "
                "x %d micro-batches (%d equal parts); microbatches x data replicas must divide "
                "every batch, the last one included (%d rows, batch_size %d)"
                % (what, bad[0], self._layout.data_size, self.microbatches, parts, n, batch))
        if self.microbatches > min(sizes):
            raise ValueError("matex.parallel: %s: more micro-batches (%d) than rows in a batch"
                             % (what, self.microbatches))

    def _sync_replicas(self):
        """Stage weights from data replica 0 (once), so replicas start equal."""
        if self._synced or self._layout.data_size == 1:
            self._synced = True
            return
        _collectives.broadcast_variables(self.stage.variables, 0)
        self._synced = True

    def _refusing_recovery(self, call):
        """``call()``; a rank failure becomes ``RankFailure`` naming the lost ranks, everywhere.

        A pipeline cannot go on without a stage (its weights exist on no other
        rank), so MaTEx's shrink-and-continue recovery does not apply: under
        ULFM the survivors revoke the pipeline's communicators (so every rank
        still blocked in a transfer or collective fails too, instead of
        hanging), name the lost ranks and raise; the job then ends.
        """
        from matex import _resilience
        from matex.errors import RankFailure

        try:
            return call()
        except RankFailure:
            raise   # named already (a rank lost as the job started)
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not _resilience.is_failure(exc):
                raise
            lost = self._lost_ranks()
            raise RankFailure(
                "matex.parallel: rank(s) %s of this pipeline failed; pipelined runs cannot "
                "recover from a rank failure (a lost stage's weights exist nowhere else), so "
                "the job ends. Restart it from a checkpoint (pm.save_checkpoint, then "
                "pm.restore_checkpoint in a new job, with as many data replicas as remain)."
                % (", ".join(map(str, lost)) if lost else "?")) from exc

    def _lost_ranks(self):
        """World ranks (of the pipeline's grid) that failed, after revoking its communicators."""
        from matex.parallel._grid import revoke_and_find_lost

        layout = self.__dict__.get("_layout")   # None while the pipeline is set up
        comms = [_runtime.comm()]
        g = layout.grid if layout is not None else None
        if g is not None:
            comms += [g.pipeline_comm, g.tensor_comm, g.world_comm]
        return revoke_and_find_lost(comms, layout.control if layout is not None
                                    else _runtime.control())

    def _quiet(self, verbose):
        return verbose if self._layout.world_rank == 0 else 0

    def _shuffled_in_one_order(self, x, y, batch_size, kwargs):
        """``fit``'s array input, shuffled the same way on every rank of the pipeline.

        Keras shuffles arrays with each process's own random state: ranks of
        an unseeded (or per-rank seeded) script would run different rows
        through the stages, inputs on the first stage mismatched with labels on
        the last. With ``shuffle`` on (Keras's default), MaTEx shuffles instead:
        one permutation of the rows per epoch, from a seed drawn from world rank
        0's NumPy generator and shared (so a seeded script stays reproducible),
        batches handed to Keras as a dataset with ``shuffle=False``. A
        ``validation_split`` is taken first, from the end, as Keras takes it.
        Other inputs (datasets, generators) are returned unchanged.
        """
        if not kwargs.get("shuffle", True) or x is None or not _batch_slicing.is_array_input(x):
            return x, y, batch_size, kwargs
        kwargs = dict(kwargs, shuffle=False)
        sample_weight = kwargs.pop("sample_weight", None)
        split = kwargs.pop("validation_split", 0.0)
        data = keras.tree.lists_to_tuples(keras.utils.pack_x_y_sample_weight(x, y, sample_weight))
        if split and kwargs.get("validation_data") is None:
            data, kwargs["validation_data"] = _split_off_validation(data, split)
        L = self._layout
        seed = L.control.bcast(int(np.random.randint(2 ** 31 - 1)) if L.world_rank == 0
                               else None, root=0)
        return _SharedOrder(data, batch_size or 32, seed).dataset(), None, None, kwargs

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: str | int = "auto", **kwargs: Any) -> keras.callbacks.History:
        self._require_built()

        def run():   # the set-up's collectives too: a stage may be lost in any of them
            _agreed(self._layout.control,
                    lambda: self._check_array_batches(x, batch_size, "fit"))
            self._sync_replicas()
            data, labels, batch, rest = self._shuffled_in_one_order(x, y, batch_size, kwargs)
            return super(PipelineModel, self).fit(data, labels, batch_size=batch, epochs=epochs,
                                                  verbose=self._quiet(verbose), **rest)

        return self._refusing_recovery(run)

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: str | int = "auto", **kwargs: Any) -> float | list | dict:
        self._require_built()

        def run():
            _agreed(self._layout.control,
                    lambda: self._check_array_batches(x, batch_size, "evaluate"))
            self._sync_replicas()
            return super(PipelineModel, self).evaluate(
                x, y, batch_size=batch_size, verbose=self._quiet(verbose), **kwargs)

        return self._refusing_recovery(run)

    def predict(self, x: Any, batch_size: int | None = None, verbose: str | int = "auto",
                **kwargs: Any) -> np.ndarray:
        self._require_built()

        def run():
            self._sync_replicas()
            return super(PipelineModel, self).predict(
                x, batch_size=batch_size, verbose=self._quiet(verbose), **kwargs)

        return self._refusing_recovery(run)

    # ---- the whole model: gather, save -----------------------------------------

    def stage_bytes(self) -> int:
        """Bytes of this rank's stage parameters (trainable and not)."""
        return _nbytes(self.stage.variables) if self.stage is not None else 0

    def gather_model(self, root: int = 0) -> keras.Model | None:
        """The whole model, every stage's weights in it, on world rank ``root`` (None elsewhere).

        Collective. ``StageBoundary`` layers become ``keras.layers.Identity`` and
        tensor-parallel layers (``ColumnParallelDense``, ``RowParallelDense``,
        ``ParallelConv2D``) the ordinary ``Dense`` / ``Conv2D`` they split, their
        shards concatenated over the tensor group, so the result is plain Keras.
        Data replica 0 provides the weights (the replicas are equal), streamed to
        ``root`` one weight at a time (``_streamgather.stream_gather``, shared with
        ``matex.parallel.gather_model``): root holds the model it returns plus one
        weight, the others only their own pieces. An error on any rank is a
        ValueError on every rank, naming the failing rank.
        """
        from matex.parallel._streamgather import stream_gather

        self._require_built()
        L = self._layout
        what = "matex.parallel: gathering the pipeline"
        offers = self._offers()
        # root builds the plain model, then receives it weight by weight (one at a time)
        whole = on_every_rank(L.control, lambda: self._assembled({})
                              if L.world_rank == root else None,
                              error_type=ValueError, what=what)

        def sink(key, value):
            whole.get_layer(key[0]).weights[key[1]].assign(value)

        stream_gather(L.control, root, offers, sink, what)
        return whole

    def _offers(self):
        """This rank's pieces of the whole model, keyed ``(layer name, weight index)``
        (data replica 0 gives them); collective: an error anywhere is a ValueError
        on every rank."""
        from matex.parallel import _tensor

        L = self._layout

        def collect():
            offers = []
            if L.data_rank != 0:
                return offers
            for name in self.plan.stage_layers[L.pipeline_rank]:
                layer = self.stage.get_layer(name)
                if isinstance(layer, _tensor._TensorParallel):
                    if L.grid is None:
                        raise ValueError(
                            "matex.parallel: layer %r is tensor-parallel but this pipeline "
                            "has no grid; pass grid= (the grid its layers use)" % name)
                elif L.tensor_rank != 0:
                    continue
                offers.extend(_tensor.weight_offers(layer, (name,)))
            return offers

        # every rank raises the same error (ValueError) if collecting failed anywhere
        return on_every_rank(L.control, collect, error_type=ValueError,
                             what="matex.parallel: gathering the pipeline")

    def _assembled(self, weights):
        """The whole model as plain Keras, with ``weights`` (layer name -> arrays)."""
        if isinstance(self._whole_config, Exception):
            raise ValueError("matex.parallel: the model's config cannot be serialized, so "
                             "the whole model cannot be rebuilt: %s: %s"
                             % (type(self._whole_config).__name__, self._whole_config))
        whole = keras.saving.deserialize_keras_object(self._whole_config)
        if not whole.built:
            whole.build(self._input_shape)
        for layer in whole.layers:
            if layer.name in weights and weights[layer.name]:
                layer.set_weights(weights[layer.name])
        return whole

    def save(self, filepath: str | os.PathLike, overwrite: bool = True, **kwargs: Any) -> None:
        """Write the whole model (every stage) as one plain Keras file; rank 0 writes.

        Collective. Load it anywhere with ``keras.models.load_model`` (no MaTEx
        needed). The optimizer state is not saved. Rank 0 never holds the whole
        model: it builds it weightless, writes the file's layout and then each
        weight as it arrives (``_streamsave``; a file object, a remote URL or
        other ``keras.Model.save`` options save from a gathered model instead).
        Raises on every rank if gathering failed (ValueError) or writing did (a
        ``RuntimeError``: ``MatexError``, naming rank 0 and its error).
        """
        from matex.parallel import _streamsave

        if _streamsave.streamable(filepath, **kwargs):
            # rank 0 builds the model weightless and writes each weight as it arrives
            self._require_built()
            L = self._layout
            _streamsave.save_streamed(
                L.control, 0, lambda: self._assembled({}), self._offers(),
                lambda whole, key: whole.get_layer(key[0]).weights[key[1]], filepath,
                overwrite, "matex.parallel: gathering the pipeline")
            return
        whole = self.gather_model(0)   # collective; an error is raised on every rank

        def write():
            if whole is not None:
                keras.Model.save(whole, filepath, overwrite=overwrite, **kwargs)

        # rank 0 writes; a failure there (a bad path, a full disk) is raised on every rank
        on_every_rank(self._layout.control, write, error_type=RemoteError,
                      what="matex.parallel: saving %s" % (filepath,))
