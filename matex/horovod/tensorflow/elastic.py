"""``horovod.tensorflow.elastic``: states of TensorFlow variables and Keras models.

``TensorFlowKerasState(model, optimizer, **objects)`` and
``TensorFlowState(variables, **objects)`` commit copies of the variables'
values in host memory, put them back on ``restore`` and broadcast them from
the root on ``sync``. A Keras state's commit also holds its optimizer's step
states (``matex._recovery.step_states``: ``backward_passes_per_step``'s counter
and accumulators, a compressor's residuals), put back with it, so a call that
a rank loss interrupted leaves no trace in them.
``run`` is ``matex.horovod.elastic.run`` (see there: MaTEx's recovery loop, and
the write-through to disk under ``matexrun --elastic``). Eager TensorFlow 2
only (TF1 sessions: ValueError).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from matex.horovod.elastic import ObjectState, State, run, run_fn

__all__ = ["TensorFlowKerasState", "TensorFlowState", "ObjectState", "State", "run",
           "run_fn"]


def _values(variables: list) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables: list, values: list) -> None:
    if len(variables) != len(values):
        raise ValueError("hvd.elastic: the state holds %d variables but %d values were "
                         "committed" % (len(variables), len(values)))
    for v, value in zip(variables, values):
        v.assign(value)


def _broadcast(variables: list, root: int) -> None:
    from matex import _collectives

    _collectives.broadcast_variables(variables, root)


class _VariablesMixin:
    """Committed copies of ``_variables()``; ``ObjectState`` does the keyword objects."""

    _saved_values: list
    _root: int

    def _variables(self) -> list:
        raise NotImplementedError()

    def _save_values(self) -> None:
        self._saved_values = _values(self._variables())

    def _sync_values(self) -> None:
        _broadcast(self._variables(), self._root)
        self._save_values()


class TensorFlowKerasState(_VariablesMixin, ObjectState):
    """A Keras model and its optimizer (Horovod's ``hvd.elastic.TensorFlowKerasState``).

    Args:
      model: a built Keras model.
      optimizer: its optimizer (default ``model.optimizer``).
      backend: unused (TF1 Keras sessions).
      kwargs: further objects to keep (``epoch=0, batch=0``), as attributes.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if not tf.executing_eagerly():
            raise ValueError("hvd.elastic on MaTEx needs eager TensorFlow 2 (no TF1 session)")
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        from matex import _recovery

        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backend = backend
        self._build_optimizer()   # its slots exist from the first commit on
        self._step_keys = _recovery.joined(self.optimizer)   # in step_states' order
        self._step_states = _recovery.step_states(self.optimizer, self._variables)
        self._save_values()
        super().__init__(**kwargs)

    def _save_values(self) -> None:
        super()._save_values()
        for s in self._step_states:   # snapshots taken at the commit, put back with it
            s.begin_step()

    def _optimizer_variables(self) -> list:
        if self.optimizer is None:
            return []
        found = self.optimizer.variables
        return list(found() if callable(found) else found)

    def _variables(self) -> list:
        return list(self.model.variables) + self._optimizer_variables()

    def _build_optimizer(self) -> None:
        from matex.legacy import _keras2

        if self.optimizer is not None and _keras2.is_keras2(self.optimizer):
            _keras2.build_optimizer(self.optimizer, self.model.trainable_variables)
        elif self.optimizer is not None and not getattr(self.optimizer, "built", True):
            self.optimizer.build(self.model.trainable_variables)

    def save(self) -> None:
        self._save_values()
        super().save()

    def restore(self) -> None:
        _assign(self._variables(), self._saved_values)   # iterations too: the commit's
        for s in self._step_states:
            s.restore()
            s.begin_step()   # the commit stays the point to go back to
        super().restore()

    def sync(self) -> None:
        """Rank ``root``'s model and optimizer state, then the objects. An optimizer built
        on some rank only (it has stepped there, or a commit was loaded) is built first
        everywhere, so every rank holds the same variables."""
        from matex import _recovery, _runtime

        if self.optimizer is not None and any(_runtime.control().allgather(
                bool(getattr(self.optimizer, "built", True)))):
            self._build_optimizer()
        for s in self._step_states:   # the root's shared step state (the accumulation count)
            s.sync(self._root)
        self._sync_values()
        _recovery.mark_first_step_synced(self.optimizer)   # this broadcast replaced it
        super().sync()

    def committed(self) -> Any:
        return {"variables": self._saved_values, "objects": super().committed()}

    def disk_extras(self) -> Any:
        """The optimizer's step states as a commit on disk holds them (the accumulation
        counter and the ranks' accumulators summed), by key (collective)."""
        held = {key: s.committed() for key, s in zip(self._step_keys, self._step_states)}
        return {key: data for key, data in held.items() if data is not None} or None

    def load_disk_extras(self, data: Any) -> None:
        for key, s in zip(self._step_keys, self._step_states):
            if key in data:
                s.load_committed(data[key])

    def load_committed(self, data: Any) -> None:
        if len(data["variables"]) > len(self._variables()):
            self._build_optimizer()   # the commit holds the optimizer's slots
        self._saved_values = list(data["variables"])
        super().load_committed(data["objects"])   # restore(): the variables too

    def arrays(self) -> list[np.ndarray]:
        return (_values(self._variables()) + [a for s in self._step_states for a in s.arrays()]
                + super().arrays())


class TensorFlowState(_VariablesMixin, ObjectState):
    """A list of ``tf.Variable`` (Horovod's ``hvd.elastic.TensorFlowState``).

    Args:
      variables: the variables to keep (required: TF2 has no global collection).
      session: unused (TF1).
      kwargs: further objects to keep, as attributes.
    """

    def __init__(self, variables: list | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        if variables is None or not tf.executing_eagerly():
            raise ValueError("hvd.elastic.TensorFlowState on MaTEx needs eager TensorFlow 2 "
                             "and its variables (TF1 global variables are not supported)")
        self.variables = list(variables)
        self.session = session
        self._save_values()
        super().__init__(**kwargs)

    def _variables(self) -> list:
        return self.variables

    def save(self) -> None:
        self._save_values()
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_values)
        super().restore()

    def sync(self) -> None:
        self._sync_values()
        super().sync()

    def committed(self) -> Any:
        return {"variables": self._saved_values, "objects": super().committed()}

    def load_committed(self, data: Any) -> None:
        self._saved_values = list(data["variables"])
        super().load_committed(data["objects"])   # restore(): the variables too

    def arrays(self) -> list[np.ndarray]:
        return _values(self.variables) + super().arrays()
