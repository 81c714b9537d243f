"""Scripts written for a ``tf.distribute`` strategy, under MaTEx.

A script in the style of the Keras distributed-training guide creates and
compiles its model inside ``strategy.scope()``. Under MaTEx every process
keeps its strategy for its own device, and MaTEx averages across the
processes: ``fit`` slices the global batch over the ranks as without a
strategy, the strategy's ``run`` computes the rank's gradients in its replica
context, and the optimizer's ``apply`` averages them over the ranks (weighted
by each rank's rows) before Keras applies them to the strategy's variables.
The first step takes rank 0's weights, metrics are summed over the ranks:
the result is the one-process run's.

Supported, with more than one rank: a strategy with **one replica per
process**: ``MirroredStrategy`` on one device (``MirroredStrategy()`` on a
machine without GPUs, or given one device), ``OneDeviceStrategy``, and
``MultiWorkerMirroredStrategy`` without a cluster in ``TF_CONFIG`` (one
worker: the MPI ranks are the workers, no gRPC between them; a
``TF_CONFIG`` naming a cluster is removed before the script runs, see
``matex._transparent``). Refused, with
the same error on every rank, at ``compile`` (and at a custom loop's first
``apply``): several replicas in one process (MaTEx would average each
replica's gradient over the ranks on its own, in an order nothing keeps the
same across ranks), a multi-worker cluster of the strategy's own, or any
other strategy (``ParameterServerStrategy``, ``TPUStrategy``,
``CentralStorageStrategy``). Run one rank per device instead
(``matexrun -n <devices>``).

Keras's ``int(variable)`` fails on a variable created in a strategy's scope
(its value is a ``MirroredVariable``); MaTEx reads ``optimizer.iterations``
that way, so ``scalar_wrapper`` makes it read the local replica's value.
"""

import functools
from typing import Callable, Optional

import tensorflow as tf

from matex import _compat, _runtime
from matex._everywhere import agree_error
from matex.errors import MatexError

__all__ = ["StrategyError", "local_value", "model_strategy",
           "optimizer_strategy", "problem", "check_on_every_rank", "scalar_wrapper"]

# one replica per process: MaTEx's ranks then play the strategy's replicas' part
_ONE_REPLICA_KINDS = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy,
                      tf.distribute.MultiWorkerMirroredStrategy)


class StrategyError(MatexError):
    """A ``tf.distribute`` strategy MaTEx cannot run across ranks (raised on every rank)."""


def local_value(value):
    """This process's value of a ``tf.distribute`` variable or per-replica value.

    A mirrored variable holds the same value on every replica: the first
    local replica's is read. Anything else is returned as it is.
    """
    if isinstance(value, tf.distribute.DistributedValues):
        strategy = getattr(value, "distribute_strategy", None) or tf.distribute.get_strategy()
        return strategy.experimental_local_results(value)[0]
    return value


def model_strategy(model) -> Optional[tf.distribute.Strategy]:
    """The strategy ``model`` was built under, or the one in scope now; None for none."""
    strategy = _compat.model_strategy(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def optimizer_strategy(optimizer) -> Optional[tf.distribute.Strategy]:
    """The strategy ``optimizer`` was made under, or the one in scope now; None for none."""
    strategy = _compat.optimizer_strategy(optimizer)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def problem(strategy: Optional[tf.distribute.Strategy]) -> Optional[str]:
    """Why MaTEx cannot run ``strategy`` across ranks, or None when it can."""
    if strategy is None:
        return None
    name = type(strategy).__name__
    if not isinstance(strategy, _ONE_REPLICA_KINDS):
        return ("%s is not supported across MaTEx ranks: use MirroredStrategy, "
                "OneDeviceStrategy or MultiWorkerMirroredStrategy with one device per process, "
                "or no strategy (MaTEx's ranks are the replicas)" % name)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        resolver = getattr(strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        tasks = sum(len(t) for t in spec.values())
        if tasks > 1:
            return ("MultiWorkerMirroredStrategy was given a cluster of %d tasks (TF_CONFIG): "
                    "under MaTEx the MPI ranks are the workers; unset TF_CONFIG so that each "
                    "rank is a single worker" % tasks)
    replicas = strategy.num_replicas_in_sync
    if replicas > 1:
        devices = getattr(strategy.extended, "worker_devices", ())
        return ("%s has %d replicas in this process (%s): MaTEx supports one replica per "
                "process; run one rank per device (matexrun -n <devices>) and give each "
                "process one device (MirroredStrategy([device]), OneDeviceStrategy(device), "
                "or no strategy)" % (name, replicas, ", ".join(devices) or "?"))
    return None


def check_on_every_rank(strategy: Optional[tf.distribute.Strategy], where: str) -> None:
    """Raise ``StrategyError`` on every rank if ``strategy`` cannot run on some rank.

    Collective over MaTEx's control communicator when more than one rank
    runs and a strategy is in use (every rank of a script reaches the same
    ``compile``); a single process runs any strategy as it is.
    """
    if strategy is None or _runtime.size() == 1:
        return
    reason = problem(strategy)
    agree_error(_runtime.control(), StrategyError(reason) if reason else None,
                error_type=StrategyError, what="matex: %s" % where)


def scalar_wrapper(convert: Callable) -> Callable:
    """A wrapper for Keras ``Variable.__int__``/``__float__``: distributed values read locally."""
    def wrapper(original):
        @functools.wraps(original)
        def scalar(self):
            if len(self.shape) == 0 and isinstance(self.value, tf.distribute.DistributedValues):
                return convert(local_value(self.value).numpy())
            return original(self)

        return scalar

    return wrapper
