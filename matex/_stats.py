"""Bytes on the wire: what each rank hands to MPI for gradients, per step and per variable.

    >>> matex.stats()
    {'steps': 100, 'bytes_sent_per_step': 41312.0, 'dense_bytes_per_step': 3971080.0,
     'by_variable': {'dense/kernel': 39240.0, ...}, 'dense_by_variable': {...}, ...}

Counted: the payload bytes of the gradient collectives of ``DistributedOptimizer``
and ``DistributedGradientTape`` (an allreduce of n bytes counts n; a fused
allreduce counts each gradient's bytes; the sparse allreduce counts every
byte this rank sends in its exchange, 16-byte headers included, read from the
op at run time; ``delay=1`` counts each gradient's bytes every step, as its
non-blocking allreduce sends them; ``LocalSGD``/``DiLoCo`` count every
trainable variable's bytes at each synchronisation and 0 on the other steps,
their "dense" being the gradients data parallelism would send every step).
Not counted: the 16-byte agreement check before each
collective, the first step's weight broadcast, MPI's own protocol and the
algorithm's internal copies (a ring allreduce moves about twice n). "dense"
is what the uncompressed path sends: the full gradient in its own dtype (an
``IndexedSlices`` gradient densified, as MaTEx did before the sparse
allreduce). Static sizes are fixed when the step is traced; dynamic ones
(sparse exchanges, PowerSGD before its start step) are added by the step
itself, in one ``assign_add`` per step on an int64 variable.
"""

import threading

import tensorflow as tf

from matex import _compat, _state

_lock = threading.Lock()
# tuple of variable names -> tf.Variable int64 [2, V + 1]: sent, dense; steps. Emptied by
# clear_session: stats() counts anew for the next model
_ledgers = _state.table("stats.ledgers", lifetime="session")


def record(names, sent, dense):
    """Add one step of ``sent`` and ``dense`` bytes (ints or int64 scalars) per name."""
    if not names:
        return
    with tf.init_scope():   # the outermost context: eager, or a TF1 graph (also from inside
        eager = tf.executing_eagerly()   # a v2 cond/function built in that graph)
    if not eager:
        # a TF1 graph: stats() reads values eagerly, and a ledger variable would land in the
        # script's graph (its global variables, its checkpoints) and in no other graph
        return
    key = tuple(names)
    with _lock:
        ledger = _ledgers.get(key)
        if ledger is None:
            ledger = _compat.bookkeeping_variable(lambda: tf.zeros([2, len(key) + 1], tf.int64),
                                                  "matex_bytes_ledger")
            _ledgers[key] = ledger

    def row(values):
        return [tf.cast(v, tf.int64) if isinstance(v, tf.Tensor) else tf.constant(int(v), tf.int64)
                for v in values] + [tf.constant(1, tf.int64)]

    ledger.assign_add(tf.stack([tf.stack(row(sent)), tf.stack(row(dense))]))


def reset():
    """Forget everything counted so far."""
    with _lock:
        for ledger in _ledgers.values():
            ledger.assign(tf.zeros_like(ledger))


def stats() -> dict:
    """Bytes this rank handed to MPI for gradients, per step (averaged over steps) and per variable.

    Returns a dict: ``steps`` (reduction steps counted; the largest over the
    variable sets seen), ``bytes_sent_per_step``, ``dense_bytes_per_step``
    (what the uncompressed path would send), ``ratio`` (dense / sent),
    ``bytes_sent`` and ``dense_bytes`` (totals), ``by_variable`` and
    ``dense_by_variable`` ({name: bytes per step}).
    """
    with _lock:
        tables = [(key, ledger.numpy()) for key, ledger in _ledgers.items()]
    steps, sent, dense = 0, 0, 0
    per_step_sent = per_step_dense = 0.0
    by_variable, dense_by_variable = {}, {}
    for names, table in tables:
        n = int(table[0, -1])
        if n == 0:
            continue
        steps = max(steps, n)
        sent += int(table[0, :-1].sum())
        dense += int(table[1, :-1].sum())
        per_step_sent += float(table[0, :-1].sum()) / n
        per_step_dense += float(table[1, :-1].sum()) / n
        for j, name in enumerate(names):
            by_variable[name] = by_variable.get(name, 0.0) + float(table[0, j]) / n
            dense_by_variable[name] = dense_by_variable.get(name, 0.0) + float(table[1, j]) / n
    return {
        "steps": steps,
        "bytes_sent_per_step": per_step_sent,
        "dense_bytes_per_step": per_step_dense,
        "ratio": per_step_dense / per_step_sent if per_step_sent else None,
        "bytes_sent": sent,
        "dense_bytes": dense,
        "by_variable": by_variable,
        "dense_by_variable": dense_by_variable,
    }
