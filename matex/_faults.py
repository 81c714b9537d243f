"""Fault injection: make chosen ranks fail at chosen steps, on purpose.

    MATEX_INJECT_FAULT="rank=2,step=30,kind=kill"           (or matexrun --inject-fault ...)
    MATEX_INJECT_FAULT="rank=1,step=5,kind=exception; rank=3,step=5,kind=hang"

Fields of one fault (faults are separated by ``;``):

* ``rank``: the rank (in ``MPI_COMM_WORLD``, so stable across shrinks) that fails.
* ``step``: the optimizer step (``optimizer.iterations``, counted from 0 over
  the whole training) at which it fails.
* ``kind``: ``kill`` (SIGKILL itself), ``exception`` (raise inside the step),
  ``hang`` (SIGSTOP itself: alive but silent, caught by the failure detector).
* ``at`` (optional): ``allreduce`` (default: inside the step, right before the
  gradient allreduce, while the other ranks are already in it), ``begin``
  (before the step's forward pass; Keras ``fit`` only), ``evaluate`` (on
  entering Keras ``evaluate``; ``step`` is the optimizer step count then),
  ``checkpoint`` (on rank 0 while it writes a checkpoint, after the data and
  before the rename; ``step`` is then the optimizer step at which the
  checkpoint is written), ``fit`` (on entering Keras ``fit``, before its
  set-up; ``step`` is the optimizer step count then), ``build`` (while a
  training step is traced, before the optimizer's first-step broadcast of
  rank 0's state; ``step`` is the optimizer step count then) or
  ``start`` (under ULFM, during MaTEx's start-up, after MPI is initialised and
  before the first collective; ``step`` must be 0) or ``init`` (under ULFM, in
  ``python -m matex`` before it reports to ``matexrun --ft`` or initialises
  MPI: a rank lost while the job starts; ``step`` must be 0) or ``seed`` (in
  ``python -m matex`` after MaTEx started, as the script's random seed is
  shared; ``step`` must be 0) or ``elastic`` (on entering ``hvd.elastic.run``'s
  function, before its first collective; ``step`` counts the calls, from 0).

A fault fires once.
"""

import os
import signal

from matex import _config, _state

KINDS = ("kill", "exception", "hang")
PLACES = ("allreduce", "begin", "evaluate", "checkpoint", "start", "fit", "build", "init",
          "seed", "elastic")


class InjectedFault(RuntimeError):
    """The ``exception`` kind of injected fault."""


class Fault:
    def __init__(self, rank, step, kind, at="allreduce"):
        self.rank, self.step, self.kind, self.at = rank, step, kind, at

    def __repr__(self):
        return "rank=%d,step=%d,kind=%s,at=%s" % (self.rank, self.step, self.kind, self.at)


def parse(spec):
    """The list of ``Fault``s described by ``spec``; ValueError names what is wrong."""
    faults = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        fields = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError("fault %r: %r is not key=value" % (part, item))
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"rank", "step", "kind", "at"}
        if unknown:
            raise ValueError("fault %r: unknown field(s) %s" % (part, ", ".join(sorted(unknown))))
        try:
            rank, step = int(fields["rank"]), int(fields["step"])
        except KeyError as exc:
            raise ValueError("fault %r: missing %s" % (part, exc.args[0])) from None
        except ValueError:
            raise ValueError("fault %r: rank and step must be integers" % part) from None
        kind = fields.get("kind", "kill")
        at = fields.get("at", "allreduce")
        if kind not in KINDS:
            raise ValueError("fault %r: kind must be one of %s" % (part, ", ".join(KINDS)))
        if at not in PLACES:
            raise ValueError("fault %r: at must be one of %s" % (part, ", ".join(PLACES)))
        faults.append(Fault(rank, step, kind, at))
    return faults


_now = _state.namespace("faults", "process", pending=None)


def _world_rank():
    import sys

    if "mpi4py.MPI" not in sys.modules:   # before MPI starts (at=init): the launcher's rank
        return _config.launched_rank()
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def pending():
    """This rank's faults not yet fired (parsed once from MATEX_INJECT_FAULT)."""
    if _now.pending is None:
        rank = _world_rank()
        _now.pending = [f for f in parse(_config.inject_fault_spec()) if f.rank == rank]
    return _now.pending


def maybe_fail(step, at):
    """Fire this rank's fault planned for ``step`` at place ``at``, if any."""
    for fault in list(pending()):
        if fault.step == int(step) and fault.at == at:
            _now.pending.remove(fault)
            _fire(fault)


def _fire(fault):
    import sys

    import time

    print("matex: injecting fault %r at t=%.6f" % (fault, time.time()), file=sys.stderr,
          flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise InjectedFault("injected fault %r" % fault)


def graph_hook(step):
    """An op that runs ``maybe_fail(step, "allreduce")`` when executed; None (and nothing
    read from ``step``, a tensor or the step counter's variable) if no fault is planned."""
    import tensorflow as tf

    if not pending():
        return None
    step_tensor = tf.convert_to_tensor(step)

    def hook(step):
        maybe_fail(int(step), "allreduce")
        return step

    return tf.py_function(hook, [step_tensor], step_tensor.dtype)
