"""How a ``PipelineModel`` runs: this rank's place, the transfers, the schedule, the steps.

``PipelineExecution`` holds what a training, evaluation or prediction step does
on this rank's stage (``_pipeline`` has the Keras model around it): cut the
data replica's batch into M micro-batches, run them through the stages in the
schedule's order (``_schedule``), activations forward and gradients back with
``matex.parallel.send``/``recv``/``sendrecv`` inside the step's
``tf.function``, sum the micro-batches' gradients (micro-batch m's loss counts
1/M), average them over the data replicas and apply them; metrics are
computed on the last stage and shared exactly (``get_metrics_result``).
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import tensorflow as tf
from mpi4py import MPI

from matex import _collectives, _compat, _fusion, _runtime
from matex._everywhere import on_every_rank
from matex.parallel import _p2p, _schedule

_TAG = 17   # p2p channel of pipeline transfers (forward and backward go opposite ways)


class _Layout:
    """This rank's place: pipeline rank/size/slot, data rank/size/slot, a control comm."""

    def __init__(self, grid):
        from matex.parallel import _grid

        grid = grid if grid is not None else _grid.current()
        self.grid = grid
        if grid is None:
            comm = _runtime.comm()
            self.pipeline_rank, self.pipeline_size = comm.Get_rank(), comm.Get_size()
            self.pipeline_slot = 0
            self.data_rank, self.data_size = 0, 1
            self.tensor_rank, self.tensor_size = 0, 1
            world = comm
        else:
            self.pipeline_rank, self.pipeline_size = grid.pipeline_rank, grid.pipeline_size
            self.pipeline_slot = grid.pipeline_slot
            self.data_rank, self.data_size = grid.data_rank, grid.data_size
            self.tensor_rank, self.tensor_size = grid.tensor_rank, grid.tensor_size
            world = grid.world_comm
        # MaTEx's own Python-level messages of this pipeline (plans, errors, saving),
        # freed with the layout (its PipelineModel): a search building one model per
        # trial must not run out of communicators
        self.control = world.Dup()
        self.world_rank = self.control.Get_rank()
        weakref.finalize(self, _free, self.control).atexit = False

    @property
    def first(self):
        return self.pipeline_rank == 0

    @property
    def last(self):
        return self.pipeline_rank == self.pipeline_size - 1


def _free(comm):
    """Free ``comm`` (local in Open MPI and MPICH, so garbage collection may do it)."""
    if MPI.Is_finalized() or comm == MPI.COMM_NULL:
        return
    try:
        comm.Free()
    except MPI.Exception:
        pass   # revoked by a failure: nothing left to release


def _agreed(control, function):
    """``function()`` on every rank of ``control``; an error on any rank is a ValueError
    on every rank, naming the lowest failing rank and its error (``on_every_rank``)."""
    return on_every_rank(control, function, error_type=ValueError)


class PipelineExecution:
    """The steps of a ``PipelineModel`` on this rank's stage (a mixin of ``PipelineModel``:
    it uses its ``stage``, ``_layout``, ``microbatches``, ``schedule`` and Keras state)."""

    # ---- transfers ------------------------------------------------------------

    def _recv(self, shape, dtype, source):
        return _p2p.recv(shape, dtype, source, comm=self._layout.pipeline_slot, tag=_TAG)

    def _send(self, tensor, dest):
        return _p2p.send(tensor, dest, comm=self._layout.pipeline_slot, tag=_TAG)

    def _sendrecv(self, tensor, dest, source, shape, dtype):
        return _p2p.sendrecv(tensor, dest, source, shape, dtype,
                             comm=self._layout.pipeline_slot, tag=_TAG)

    # ---- data ----------------------------------------------------------------

    def _replica_share(self, structure, rows):
        """This data replica's contiguous share of every tensor (rows divisible by D)."""
        D, d = self._layout.data_size, self._layout.data_rank
        if D == 1:
            return structure
        share = rows // D
        return keras.tree.map_structure(
            lambda t: None if t is None else t[d * share:(d + 1) * share], structure)

    def _check_rows(self, rows):
        M, D = self.microbatches, self._layout.data_size
        return tf.debugging.assert_equal(
            rows % (M * D), 0, message=(
                "matex.parallel: a batch's rows must divide by data replicas x microbatches "
                "= %d x %d" % (D, M)))

    # ---- the schedule ---------------------------------------------------------

    def _run(self, x, y, sample_weight, rows, train):
        """Run the schedule on this stage; returns the summed gradients (train) or None."""
        L = self._layout
        P, p, M = L.pipeline_size, L.pipeline_rank, self.microbatches
        mb = rows // M

        def part(structure, m):
            return keras.tree.map_structure(
                lambda t: None if t is None else t[m * mb:(m + 1) * mb], structure)

        in_shape, in_dtype = (None, None) if p == 0 else self._stage_input_spec()
        if p > 0:
            in_shape = tf.concat([[tf.cast(mb, tf.int64)],
                                  tf.constant(in_shape, tf.int64)], 0) \
                if in_shape else tf.reshape(tf.cast(mb, tf.int64), [1])
        out_t = self.stage.outputs[0]
        out_shape = tf.concat([[tf.cast(mb, tf.int64)],
                               tf.constant(list(out_t.shape[1:]), tf.int64)], 0) \
            if len(out_t.shape) > 1 else tf.reshape(tf.cast(mb, tf.int64), [1])
        weights = list(self.stage.trainable_variables)
        total = [None] * len(weights)
        saved = {}
        pending = None   # (tensor, peer) whose send is fused with the next receive
        has_losses = bool(self.stage.losses) if not L.last else False
        for step in _schedule.steps(self.schedule, P, p, M, train):
            m = step.micro
            if step.kind == "F":
                if step.fused_recv:
                    x_in = self._sendrecv(pending[0], pending[1], p - 1, in_shape, in_dtype)
                    pending = None
                elif step.recv is not None:
                    x_in = self._recv(in_shape, in_dtype, p - 1)
                else:
                    x_in = part(x, m)
                with tf.GradientTape(watch_accessed_variables=train) as tape:
                    if p > 0:
                        tape.watch(x_in)
                    out = self.stage(x_in, training=train)
                    loss = None
                    if L.last:
                        y_m, sw_m = part(y, m), part(sample_weight, m)
                        loss = self.compute_loss(x=None, y=y_m, y_pred=out,
                                                 sample_weight=sw_m, training=train)
                        _compat.loss_tracker(self).update_state(loss, sample_weight=mb)
                        self._skip_results = True
                        try:
                            self.compute_metrics(None, y_m, out, sample_weight=sw_m)
                        finally:
                            self._skip_results = False
                        loss = loss / M
                    elif has_losses and train:
                        loss = tf.add_n(self.stage.losses) / M
                saved[m] = (tape, x_in, out, loss)
                if step.send is not None:
                    if step.fused_send:
                        pending = (out, p + 1)
                    else:
                        self._send(out, p + 1)
            else:
                tape, x_in, out, loss = saved.pop(m)
                sources = weights + ([x_in] if p > 0 else [])
                if L.last:
                    grads = tape.gradient(loss, sources)
                else:
                    if step.fused_recv:
                        dy = self._sendrecv(pending[0], pending[1], p + 1, out_shape,
                                            out.dtype)
                        pending = None
                    else:
                        dy = self._recv(out_shape, out.dtype, p + 1)
                    if loss is not None:
                        target = tf.reduce_sum(out * tf.stop_gradient(dy)) + loss
                        grads = tape.gradient(target, sources)
                    else:
                        grads = tape.gradient(out, sources, output_gradients=dy)
                for i, g in enumerate(grads[:len(weights)]):
                    if g is not None:
                        g = tf.convert_to_tensor(g)
                        total[i] = g if total[i] is None else total[i] + g
                if p > 0:
                    dx = grads[-1]
                    if dx is None:
                        dx = tf.zeros_like(x_in)
                    if step.fused_send:
                        pending = (dx, p - 1)
                    else:
                        self._send(dx, p - 1)
        assert pending is None, "a fused transfer was left unsent"
        if not L.last:
            self._mirror_metrics(y, sample_weight, mb)
        return total if train else None

    def _mirror_metrics(self, y, sample_weight, mb):
        """On stages without the loss: give the compiled metrics the last stage's structure.

        Keras builds metric states at their first update; here they are updated
        with zero predictions of the model's output shapes (the values do not
        matter: ``get_metrics_result`` overwrites every state with the last
        stage's before reading it).
        """
        zeros = [tf.zeros(tf.concat([[mb], tf.constant(s, tf.int32)], 0), dt)
                 for s, dt in self._out_specs]
        y_pred = zeros[0] if len(zeros) == 1 else zeros
        part = keras.tree.map_structure(lambda t: None if t is None else t[:mb],
                                        (y, sample_weight))
        self._skip_results = True
        try:
            self.compute_metrics(None, part[0], y_pred, sample_weight=part[1])
        finally:
            self._skip_results = False

    def _forward_all(self, x, rows, training):
        """Forward only, M micro-batches; the whole model's outputs on every pipeline rank."""
        L = self._layout
        P, p, M = L.pipeline_size, L.pipeline_rank, self.microbatches
        mb = rows // M
        in_shape, in_dtype = (None, None) if p == 0 else self._stage_input_spec()
        outs = []
        for m in range(M):
            if p == 0:
                x_in = keras.tree.map_structure(lambda t: t[m * mb:(m + 1) * mb], x)
            else:
                shape = tf.concat([[tf.cast(mb, tf.int64)], tf.constant(in_shape, tf.int64)], 0)
                x_in = self._recv(shape, in_dtype, p - 1)
            out = self.stage(x_in, training=training)
            if p < P - 1:
                self._send(out, p + 1)
            else:
                outs.append(keras.tree.flatten(out))
        specs = self._out_specs
        if L.last:
            flat = [tf.concat([o[i] for o in outs], 0) for i in range(len(specs))]
        else:
            flat = [tf.zeros(tf.concat([[rows], tf.constant(s, tf.int32)], 0), dt)
                    for s, dt in specs]
        if P > 1:
            flat = [_collectives.broadcast(t, root=P - 1, comm=L.pipeline_slot) for t in flat]
        return flat[0] if len(flat) == 1 else flat

    # ---- Keras steps ------------------------------------------------------------

    def _replica_batch(self, data):
        """This data replica's share of a step's batch, and its row count (checked)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rows = tf.shape(keras.tree.flatten(y if x is None else x)[0])[0]
        with tf.control_dependencies([self._check_rows(rows)]):
            rows = tf.identity(rows // self._layout.data_size)
        x, y, sample_weight = self._replica_share((x, y, sample_weight),
                                                  rows * self._layout.data_size)
        return x, y, sample_weight, rows

    def train_step(self, data: Any) -> dict:
        x, y, sample_weight, rows = self._replica_batch(data)
        weights = list(self.stage.trainable_variables)
        grads = self._run(x, y, sample_weight, rows, train=True)
        if self._layout.data_size > 1:
            grads = _fusion.allreduce_gradients(grads, "average")
        self.optimizer.apply(grads, weights)
        return self.get_metrics_result()

    def test_step(self, data: Any) -> dict:
        x, y, sample_weight, rows = self._replica_batch(data)
        self._run(x, y, sample_weight, rows, train=False)
        return self.get_metrics_result()

    def predict_step(self, data: Any) -> Any:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        rows = tf.shape(keras.tree.flatten(x)[0])[0]
        D, M = self._layout.data_size, self.microbatches
        pad = (-rows) % (D * M)
        x = keras.tree.map_structure(
            lambda t: tf.concat([t, tf.zeros(tf.concat([[pad], tf.shape(t)[1:]], 0), t.dtype)],
                                0), x)
        padded = rows + pad
        x = self._replica_share(x, padded)
        out = self._forward_all(x, padded // D, training=False)
        if D > 1:
            out = keras.tree.map_structure(_collectives.allgather, out)
        return keras.tree.map_structure(lambda t: t[:rows], out)

    def get_metrics_result(self) -> dict:
        """Metric results from the last stage's states, summed over data replicas (exact)."""
        if self._skip_results:
            return {}
        L = self._layout
        variables = [v for metric in self.metrics for v in metric.variables]
        if variables and L.pipeline_size > 1:
            for v in variables:
                v.assign(_collectives.broadcast(tf.convert_to_tensor(v),
                                                root=L.pipeline_size - 1,
                                                comm=L.pipeline_slot))
        local = None
        if variables and L.data_size > 1:
            local = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
            for v, t in zip(variables, _fusion.allreduce_gradients(local, "sum",
                                                                    threshold=1 << 30)):
                v.assign(t)
        results = {}
        for metric in self.metrics:
            value = metric.result()
            if isinstance(value, dict):
                results.update(value)
            else:
                results[metric.name] = value
        if local is not None:
            results = tf.nest.map_structure(tf.identity, results)
            with tf.control_dependencies(tf.nest.flatten(results)):
                for v, t in zip(variables, local):
                    v.assign(t)
        return results
