"""The one recovery loop: run work, and after a rank failure put state right and run it again.

    run(body, states, on_recovered=None, callbacks=())

``body()`` is called until it returns. When it raises a rank failure under
ULFM, the survivors recover the communicator (``_resilience.recover``), then
every state object, in order:

1. ``restore()``: undoes this rank's uncommitted work (a step whose update
   it never applied);
2. ``sync()``: takes the new rank 0's values (collective);

then a digest of every state's ``arrays()`` is compared across survivors (a
mismatch is an error on every rank), listeners and callbacks defining
``on_rank_loss`` are told, ``on_recovered(info)`` lets the caller re-plan
(re-divide the remaining work, print), and ``body`` runs again. ``body`` must
derive where to start from the state (e.g. the optimizer's step counter), so
a redone call continues where the survivors agree the work stands. Without
ULFM a rank failure is raised as ``matex.errors.RankFailure`` (saying how
to launch with fault tolerance); any other error propagates as it is.

``fit``, ``evaluate``/``predict`` and ``run_resilient`` (custom loops) all go
through it (Horovod's elastic ``State``/``run`` and torchft's ``Manager`` are
the prior art for this shape).

Which states: per-step state joins a registry where it is made, under a
name (``join``, ``leave``), instead of the loop probing for it. A model contributes its variables
(``model_state``); everything else joins its optimizer (``join``): a
``delay=1`` path's request in flight (``_delayed.DelayState``), Local SGD's
and DiLoCo's rollback point (``localsgd.RollbackState``), a compressor's
residuals (``compression._base.CompressorState``). ``model_states(model)``
and ``step_states(optimizer, variables)`` hand the loop that list. The
commit they are all consistent with is one point too: ``matex._commit``
builds every update all-or-nothing, its step counter moving with it, and
``begin_step``/``restore`` read that counter to tell a committed step from
one to undo.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, List

if TYPE_CHECKING:
    import keras
    import tensorflow as tf

import numpy as np

from matex import _config, _resilience
from matex.errors import MatexError, MismatchError, RankFailure

_COPY_BELOW_BYTES = 64 << 10


def has_value(variable) -> bool:
    """Whether a (Keras or tf) variable can be read eagerly right now.

    One created while a step was traced has no value until that step first runs.
    """
    import tensorflow as tf

    try:
        tensor = tf.convert_to_tensor(variable)
    except (tf.errors.FailedPreconditionError, ValueError, TypeError):
        return False
    return tensor.shape == variable.shape


def mark_first_step_synced(optimizer) -> None:
    """Record that ``optimizer``'s first-step broadcast is done, on this rank (local).

    After a rank failure the recovery loop broadcasts every variable from one
    survivor, which replaces the first-step broadcast (``matex._optimizer``'s);
    every survivor must then skip it, whether or not its own had run: otherwise
    a survivor whose trace was interrupted before it would broadcast alone on
    its next trace while the others reduce gradients.
    """
    state = getattr(optimizer, "_matex", None)
    if state is None:
        return
    state.synced = True
    for flag in state.flags:
        flag.assign(False)


def _snapshot(variables):
    """Values to restore ``variables`` to later, taken cheaply.

    Small variables are copied. Large ones are read as tensors that share the
    variable's buffer: TensorFlow copies a variable's buffer before updating it
    while such a read is held (copy on write), so a large variable the step
    does not change (a frozen layer's weights) costs no copy at all.
    """
    import tensorflow as tf

    return [v.numpy() if int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size < _COPY_BELOW_BYTES
            else tf.convert_to_tensor(v) for v in variables]   # Keras or tf variables


class State:
    """Something the recovery loop keeps consistent across a rank failure (see ``join``)."""

    def begin_step(self) -> None:
        """A step begins (the loop's callers call it before every step; local)."""

    def restore(self) -> None:
        """Undo this rank's uncommitted work (local)."""

    def sync(self, root: int = 0) -> None:
        """Take rank ``root``'s values (collective): the recovery loop's new rank 0, or
        ``hvd.elastic``'s survivor with the most commits."""

    def arrays(self) -> list:
        """NumPy arrays that must be bitwise equal on every rank after ``sync`` (digested)."""
        return []

    def committed(self) -> Any:
        """What a commit written to disk holds of this state as of the last
        ``begin_step``: picklable, the same on every rank (collective: every rank
        calls it). None: nothing beyond the model's and optimizer's variables."""
        return None

    def load_committed(self, data: Any) -> None:
        """Put back ``committed``'s data on the one rank resuming from disk (local);
        ``sync`` then hands the others what they take from it."""


class SnapshotState(State):
    """Variables a step writes before its update is known to be committed on every rank.

    ``variables()`` (a callable: some are made during the first step) and
    ``counter()`` (the optimizer's step count, which moves when the update
    commits). ``begin_step`` snapshots the variables; ``restore`` puts them back
    when the counter did not move (the step's work was not committed on this
    rank), and zeroes those made since the snapshot (a step that made them
    had not begun then). Subclasses say what ``sync`` takes from rank 0 and what
    ``arrays`` digests.
    """

    def __init__(self, variables: Callable[[], list], counter: Callable[[], int]) -> None:
        self._variables_of, self._counter_of = variables, counter
        self._at: int | None = None
        self._saved: dict = {}

    def begin_step(self) -> None:
        variables = list(self._variables_of())
        self._at = int(self._counter_of())
        self._saved = {id(v): (v, value) for v, value in zip(variables, _snapshot(variables))}

    def restore(self) -> None:
        import tensorflow as tf

        if self._at is not None and int(self._counter_of()) == self._at:
            for v in self._variables_of():
                saved = self._saved_value(v)
                v.assign(saved if saved is not None else tf.zeros_like(v))
        self._at = None

    def _saved_value(self, variable: Any) -> Any:
        """``variable``'s value at the last ``begin_step``; None if it was made since."""
        saved = self._saved.get(id(variable))
        return saved[1] if saved is not None and saved[0] is variable else None

    def snapshot_of(self, variable: Any) -> np.ndarray:
        """``variable``'s value at the last ``begin_step`` (zeros: made since)."""
        saved = self._saved_value(variable)
        if saved is not None:
            return np.array(saved, copy=True)
        return np.zeros(variable.shape, variable.dtype.as_numpy_dtype)


class VariablesState(State):
    """Variables committed by an optimizer step: all-or-nothing, counted by ``counter``.

    ``variables()`` returns the variables to synchronise (a callable, since a
    model's optimizer builds its variables late); ``undo()`` returns those a
    step may change before its update (BatchNorm statistics, counters):
    ``begin_step()`` snapshots them, and ``restore()`` puts them back when the
    step's update was not applied on this rank (the counter did not move).
    """

    def __init__(self, variables, counter, undo=lambda: (), after_sync=lambda: None):
        self.variables, self.counter, self.undo = variables, counter, undo
        self.after_sync = after_sync
        self._at, self._saved = None, []

    def begin_step(self):
        self._at = int(self.counter())
        self._saved = _snapshot(self.undo())

    def restore(self):
        if self._at is not None and int(self.counter()) == self._at:
            for v, value in zip(self.undo(), self._saved):
                v.assign(value)
        self._at = None

    def sync(self, root: int = 0):
        """Take ``root``'s values if it holds every variable any survivor holds, else
        the lowest rank's that does.

        A rank can fail before every survivor's variables hold a value: one
        created while the first step was traced gets its value when that step
        first runs, which some survivors may not have reached. Which variables
        hold values is agreed first (one allgather); those held somewhere are
        broadcast from the lowest rank holding them all, those held nowhere
        are left to their initialisers. ``after_sync()`` then runs (e.g. to
        mark the optimizer's first-step broadcast done: this one replaced it).
        """
        from matex import _collectives, _runtime

        variables = list(self.variables())
        mine = [has_value(v) for v in variables]
        everyone = _runtime.control().allgather(mine)
        if len({len(m) for m in everyone}) != 1:
            raise MismatchError(
                "matex: cannot re-synchronise after a rank failure: the survivors hold "
                "different numbers of model and optimizer variables (%s)" % ", ".join(
                    "rank %d: %d" % (r, len(m)) for r, m in enumerate(everyone)))
        held = [any(column) for column in zip(*everyone)]
        if everyone[root] != held:
            root = next((r for r, m in enumerate(everyone) if m == held), None)
        if root is None:
            raise MismatchError(
                "matex: cannot re-synchronise after a rank failure: no survivor holds a "
                "value for every variable another survivor holds")
        _collectives.broadcast_variables([v for v, h in zip(variables, held) if h], root)
        self.after_sync()

    def arrays(self):
        return [v.numpy() for v in self.variables() if has_value(v)]


def model_state(model, track_steps=True):
    """The state of a Keras model: all its variables and its optimizer's (once built).

    With ``track_steps``, ``begin_step`` snapshots the non-trainable variables
    (a redone step must start from the values they had before it).
    """
    def variables():
        optimizer = getattr(model, "optimizer", None)
        extra = list(optimizer.variables) if optimizer is not None and optimizer.built else []
        return list(model.variables) + extra

    def counter():
        optimizer = getattr(model, "optimizer", None)
        return int(optimizer.iterations) if optimizer is not None else 0

    def after_sync():
        mark_first_step_synced(getattr(model, "optimizer", None))

    undo = (lambda: model.non_trainable_variables) if track_steps else (lambda: ())
    return VariablesState(variables, counter, undo, after_sync)


def join(optimizer, key: str, make: Callable[[Any, Callable[[], list]], State]) -> None:
    """Register ``make`` under ``key``: ``make(optimizer, variables)`` builds one of
    ``optimizer``'s step states. A state already under ``key`` is replaced (in its place).

    Called where per-step state is made: a ``delay=1`` path (``"delay"``: its
    request in flight), a Local SGD/DiLoCo rule (``"rollback"``), a compressor
    given to the optimizer (``"compressor"``: residuals, Q and step counter),
    Horovod's ``backward_passes_per_step`` (``"accumulation"``). ``step_states``
    builds them, in the order they joined, for each loop that runs steps.
    ``variables()``: the model's and the optimizer's variables, which a
    rollback puts back too.
    """
    _registry(optimizer, create=True)[key] = make


def _registry(optimizer, create: bool = False) -> dict:
    """``optimizer``'s step-state makers by key: in MaTEx's settings of a Keras 3
    optimizer it distributed, else (a Keras 2 one, Horovod's wrapper) in a plain
    attribute that Keras 2's tracking does not take for optimizer state."""
    settings = getattr(optimizer, "_matex", None)
    if settings is not None and hasattr(settings, "joined"):
        return settings.joined
    found = getattr(optimizer, "_matex_joined", None)
    if found is None:
        found = {}
        if create:
            object.__setattr__(optimizer, "_matex_joined", found)
    return found


def leave(optimizer, key: str) -> None:
    """Remove the step state registered under ``key`` (nothing if there is none)."""
    _registry(optimizer).pop(key, None)


def joined(optimizer) -> List[str]:
    """The keys of ``optimizer``'s step states, in their order ([] if none joined)."""
    return list(_registry(optimizer))


def step_states(optimizer, variables: Callable[[], list]) -> List[State]:
    """The states that joined ``optimizer`` (``join``), built for ``variables``, in the
    order of ``joined``; [] when none did. They go after the model's own state: their
    ``restore`` and ``sync`` run after its."""
    return [make(optimizer, variables) for make in _registry(optimizer).values()]


def model_states(model, track_steps: bool = True) -> List[State]:
    """Every per-step state of a Keras model: its variables' (``model_state``), then those
    that joined its optimizer (``step_states``)."""
    state = model_state(model, track_steps)
    return [state] + step_states(getattr(model, "optimizer", None), state.variables)


# recoveries in a row that lost no rank before the loop gives up: each recovery that
# shrinks the communicator removes a rank, so only these could repeat without end
FRUITLESS_RECOVERIES = 3


def run(body, states, on_recovered=None, callbacks=()):
    """``body()``, run again on the survivors after each rank failure (see the module doc).

    Bounded: a recovery that lost no rank (the failure seen was not a lost rank the
    shrink could remove) may repeat ``FRUITLESS_RECOVERIES`` times in a row; the next
    raises ``RankFailure`` on every survivor (they agree on the shrink, hence on this).
    """
    fruitless = 0
    while True:
        try:
            return body()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not _resilience.is_failure(exc):
                raise
            if _resilience.mode() != "ulfm":
                raise RankFailure(
                    "matex: a rank failed and this job runs without fault tolerance; "
                    "launch with `matexrun --ft` (ULFM) to continue on the survivors, or "
                    "`matexrun --restart N` to restart from checkpoints") from exc
            failure = exc
        info = _resilience.recover()
        fruitless = fruitless + 1 if info.new_size >= info.old_size else 0
        if fruitless > FRUITLESS_RECOVERIES:
            raise RankFailure(
                "matex: %d recoveries in a row lost no rank (the communicator kept its %d "
                "ranks), and the work failed again each time: giving up on the recovery "
                "loop; the last error: %s: %s" % (fruitless, info.new_size,
                                                   type(failure).__name__, failure)) from failure
        started = time.time()
        for state in states:
            state.restore()
        for state in states:
            state.sync()
        _resilience.check_replicas([a for state in states for a in state.arrays()])
        if on_recovered is not None:
            on_recovered(info)
        info.resync_seconds = time.time() - started
        _resilience.notify(info, callbacks)


def run_resilient(step: Callable[[int], Any], num_steps: int, variables: Iterable[tf.Variable],
                  optimizer: keras.optimizers.Optimizer,
                  undo_on_redo: Iterable[tf.Variable] = ()) -> int:
    """Run a custom training loop that survives rank failures (under ULFM).

    Calls ``step(i)`` for every step ``i`` not yet committed, up to
    ``num_steps``. After a rank failure the survivors recover, take every
    variable in ``variables`` (model and optimizer state) from the new rank 0,
    check that replicas agree, and go on from the first step the new rank 0 had
    not applied. Requirements on ``step``: it updates through a
    ``DistributedOptimizer`` (whose update is all-or-nothing and advances
    ``optimizer.iterations``, the commit counter), and derives its data from
    ``i``, ``matex.rank()`` and ``matex.size()`` when called, so a redone step
    is re-divided among the survivors. ``undo_on_redo``: variables a step
    changes before its update (e.g. counters, BatchNorm statistics), restored
    when that step has to be redone. Without ULFM a failure is raised.

    A call that commits nothing (``matex.should_commit`` refused the step) is
    made again with the same ``i``; ``MATEX_SKIP_LIMIT`` (5) such calls in a row
    raise ``MatexError`` on every rank, so the loop is bounded.

    Returns the number of recoveries.
    """
    variables, undo = list(variables), list(undo_on_redo)

    def after_sync():   # the recovery's broadcast replaced the first-step one (see fit's)
        mark_first_step_synced(optimizer)

    state = VariablesState(lambda: variables, lambda: optimizer.iterations, lambda: undo,
                           after_sync)
    states = [state] + step_states(optimizer, state.variables)
    recoveries = []

    def body():
        first_step_sync()
        tries, limit = 0, _config.skip_limit()
        while int(optimizer.iterations) < num_steps:
            at = int(optimizer.iterations)
            for s in states:
                s.begin_step()
            step(at)
            # a step that committed nothing (``matex.should_commit`` refused it) is called
            # again; the counter is the same on every rank, so all stop together
            tries = tries + 1 if int(optimizer.iterations) == at else 0
            if tries >= limit:
                raise MatexError(
                    "matex: run_resilient: step %d was called %d times in a row and "
                    "committed nothing (a vote refused it, or the step does not update "
                    "through a DistributedOptimizer); every rank stops here (the limit "
                    "is MATEX_SKIP_LIMIT)" % (at, tries))

    def first_step_sync():
        """Rank 0's values, eagerly, before the step is first traced. The optimizer would
        broadcast them while its ``apply`` is traced; a rank lost then would abort the
        script's ``tf.function`` in its first trace, after which TensorFlow refuses to
        create variables in any later trace ("Creating variables on a non-first call")."""
        from matex import _collectives

        if getattr(getattr(optimizer, "_matex", None), "synced", True):
            return
        _collectives.broadcast_variables([v for v in variables if has_value(v)], 0)
        mark_first_step_synced(optimizer)

    run(body, states, on_recovered=recoveries.append)
    return len(recoveries)
