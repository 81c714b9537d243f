"""``hvd.join()``: a rank out of data serves the others' reductions with zeros.

Horovod's rule: a rank that called ``join()`` takes part, with zeros, in
every allreduce the other ranks still run, until every rank has joined;
``join()`` then returns the last rank to join, on every rank. An Average
divides by all the ranks (joined ones included), as Horovod's does (its
postscale is 1/size whoever joined).

MaTEx's collectives have no name-based negotiation (every rank issues the
same collectives in the same order), so a joined rank must learn what the
others reduce. Every join-aware reduction is therefore announced first by one
small int64 allreduce (``STATUS`` values: the number of active ranks and a
description): the joined rank, looping in ``join()``, takes part in that
announcement with zeros, reads the description and issues the same reduction
with zeros; when the announcement counts no active rank, everyone has joined.

Join-aware: ``hvd.allreduce`` of a dense tensor over the global set (up to
``MAX_DIMS`` dimensions) and the gradient reductions of Horovod's
``DistributedOptimizer``/``DistributedGradientTape`` (and their ``Partial``
forms), in eager mode or in a ``tf.function``. The joined rank replays a
gradient reduction from a plan it recorded in its own earlier steps (the same
model): it must have reduced gradients once before joining. Any other
collective run by the active ranks while a rank has joined (``allgather``,
``broadcast``, ``grouped_allreduce``, Keras ``fit``'s metric averaging...)
meets the joined rank's announcement and fails on every rank with MaTEx's
mismatch error: an error, never a hang.

Announcements cost one small allreduce per reduction (2.3-3.0x an eager
``hvd.allreduce``; ``benchmarks/horovod_join.py``), which Horovod's join does
not: its coordinator negotiates every tensor anyway. So they are made only
where ``join()`` may be called: by default (``MATEX_HOROVOD_JOIN=auto``) unless
the main script imports Horovod and never refers to its ``join``
(``script_may_join``). ``MATEX_HOROVOD_JOIN=1`` turns them on, ``0`` off; when
off, ``join()`` works only when every rank joins at the same point, and a rank
joining alone gets an error naming the variable.
"""

from __future__ import annotations

import ast
import sys
import threading
import zlib
from typing import Any, Callable, Optional

import tensorflow as tf

from matex import _collectives, _config, _runtime, _state
from matex.errors import is_mismatch

STATUS = 12          # int64 values of an announcement
MAX_DIMS = STATUS - 6
_ALLREDUCE, _GRADIENTS = 1, 2

_local = _state.local("horovod.join.local")   # .serving: this thread is inside join()
# key -> (reduction, grads template, variables). Process state, not a session cache:
# a traced step records its plan only when traced, and join() fails on a missing plan
# instead of rebuilding it, so emptying this would break a traced step still in use.
_plans: dict[int, tuple] = _state.table("horovod.join.plans", lifetime="process")
_plans_lock = threading.Lock()


def _is_horovod(module: str) -> bool:
    return module.split(".")[0] == "horovod" or module.startswith("matex.horovod")


def script_may_join(source: str) -> Optional[bool]:
    """Whether a script's source may call Horovod's ``join``; None: it imports no Horovod.

    True when it imports ``join`` from a Horovod module, or refers to ``.join`` on a
    name a Horovod import binds (``hvd.join``, ``horovod.tensorflow.join``); a
    ``join`` on anything else (``os.path.join``, ``", ".join``) does not count.
    """
    tree = ast.parse(source)
    bound: set = set()   # names a Horovod import binds
    imports = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_horovod(alias.name):
                    imports = True
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            horovod = _is_horovod(node.module)
            for alias in node.names:
                if horovod or (node.module == "matex" and alias.name == "horovod"):
                    imports = True
                    if alias.name == "join":
                        return True
                    bound.add(alias.asname or alias.name)
    if not imports:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "join":
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                return True
    return False


def _main_script() -> Optional[str]:
    """The main script's source, or None (an interactive session, ``-c``, unreadable)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not str(path).endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


_now = _state.namespace("horovod.join",
                        decided=None)   # MATEX_HOROVOD_JOIN=auto's answer, once per process


def announcing() -> bool:
    """Whether this process's Horovod-API reductions are announced (``MATEX_HOROVOD_JOIN``)."""
    setting = _config.horovod_join()
    if setting != "auto":
        return setting == "1"
    if _now.decided is None:
        source = _main_script()
        try:
            may = script_may_join(source) if source is not None else None
        except (SyntaxError, ValueError):
            may = None
        _now.decided = may is not False   # off only for a Horovod script that never joins
    return _now.decided


def enabled() -> bool:
    """Whether reductions announce themselves now (not inside ``join()`` itself)."""
    return announcing() and not getattr(_local, "serving", False)


def _announce(values: list) -> tf.Tensor:
    """The announcement's allreduce: this active rank's description (1 first)."""
    values = [1] + list(values)
    values += [0] * (STATUS - len(values))
    if all(isinstance(v, int) for v in values):   # one constant: eagerly, one op less each
        status = tf.constant(values, tf.int64)
    else:
        status = tf.stack([tf.cast(v, tf.int64) for v in values])
    return _collectives.allreduce(status, "sum")


def announced_allreduce(tensor: tf.Tensor, op: int, scaled: bool) -> tf.Tensor:
    """``tensor``, after announcing its allreduce (identity with a dependency in graphs)."""
    if not enabled() or tensor.shape.rank is None or tensor.shape.rank > MAX_DIMS:
        return tensor
    if tensor.shape.is_fully_defined():
        dims = [int(d) for d in tensor.shape]
    else:
        shape = tf.shape(tensor, out_type=tf.int64)
        dims = [shape[i] for i in range(tensor.shape.rank)]
    status = _announce([_ALLREDUCE, tensor.dtype.as_datatype_enum, op, int(scaled),
                        tensor.shape.rank] + dims)
    if tf.executing_eagerly():
        return tensor
    with tf.control_dependencies([status]):
        return tf.identity(tensor)


def _template(grads: list, variables: list | None) -> list:
    """What a gradient list looks like: None, ("dense", dtype, shape), ("sparse", ...)."""
    out = []
    for i, g in enumerate(grads):
        if g is None:
            out.append(None)
        elif isinstance(g, tf.IndexedSlices):
            shape = (tuple(variables[i].shape) if variables is not None
                     else tuple(tf.get_static_value(g.dense_shape)))
            out.append(("sparse", g.values.dtype.name, shape, g.indices.dtype.name))
        else:
            out.append(("dense", g.dtype.name, tuple(g.shape)))
    return out


def _zeros(template: list) -> list:
    out: list[Any] = []
    for t in template:
        if t is None:
            out.append(None)
        elif t[0] == "dense":
            out.append(tf.zeros(t[2], t[1]))
        else:
            _, dtype, shape, index_dtype = t
            out.append(tf.IndexedSlices(tf.zeros((0,) + tuple(shape[1:]), dtype),
                                        tf.zeros([0], index_dtype),
                                        tf.constant(shape, tf.int64)))
    return out


def announce_gradients(reduction: Any, grads: list, variables: list | None) -> Any:
    """Announce a gradient reduction and record its plan; returns a dependency or None."""
    if not enabled():
        return None
    try:
        template = _template(grads, variables)
    except (TypeError, ValueError):   # a shape known only at run time: not announced, so a
        return None                   # joined rank meets the mismatch error, never a hang
    local = ([id(v) in reduction._local_ids() for v in variables] if variables is not None
             else [])
    description = repr((template, local, reduction.op, repr(reduction.compressor),
                        reduction.sparse_as_dense, reduction.scale_local))
    key = zlib.crc32(description.encode())
    with _plans_lock:
        _plans[key] = (reduction, template, variables)
    return _announce([_GRADIENTS, key])


def join(allreduce: Callable[..., Any]) -> tf.Tensor:
    """Serve the other ranks' announced reductions with zeros until every rank has joined.

    ``allreduce`` is ``hvd.allreduce``: an announced eager allreduce is served
    by the same call with zeros, so that its collectives match the others'.
    Returns the last rank to join (an int32 scalar tensor), the same on every
    rank. Eager only.
    """
    if not tf.executing_eagerly():
        raise NotImplementedError("hvd.join() runs eagerly (call it outside tf.function)")
    first = True
    announced = announcing()
    _local.serving = True
    try:
        while True:
            try:
                status = _collectives.allreduce(tf.zeros([STATUS], tf.int64), "sum").numpy()
            except Exception as exc:
                if announced or not is_mismatch(exc):
                    raise
                raise RuntimeError(
                    "hvd.join(): the other ranks ran a reduction while this rank joined, and "
                    "reductions are not announced (MATEX_HOROVOD_JOIN=%s%s): set "
                    "MATEX_HOROVOD_JOIN=1 where ranks join at different points"
                    % (_config.horovod_join(), ", and the main script never calls join"
                       if _config.horovod_join() == "auto" else "")) from exc
            active = int(status[0])
            if active == 0:
                break
            first = False
            kind, *description = (int(v) // active for v in status[1:])
            if kind == _ALLREDUCE:
                dtype, op, scaled, rank = description[:4]
                shape = description[4:4 + rank]
                allreduce(tf.zeros(shape, tf.dtypes.as_dtype(dtype)), op=op,
                               postscale_factor=2.0 if scaled else 1.0)
            elif kind == _GRADIENTS:
                with _plans_lock:
                    plan = _plans.get(description[0])
                if plan is None:
                    raise RuntimeError(
                        "hvd.join(): the other ranks reduce gradients this rank never "
                        "reduced (it must reduce the same gradients once before joining)")
                reduction, template, variables = plan
                reduction.reduce(_zeros(template), variables)
            else:
                raise RuntimeError("hvd.join(): an announcement this MaTEx does not know "
                                   "(kind %d)" % kind)
    finally:
        _local.serving = False
    last = _collectives.allreduce(tf.constant(_runtime.rank() if first else -1, tf.int64),
                                  "max")
    return tf.cast(last, tf.int32)
