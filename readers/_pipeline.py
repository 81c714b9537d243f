"""Batches read ahead on a thread pool, and their tf.data.Dataset.

``stream`` keeps up to ``depth`` groups of batches in flight: each group's
rows are sorted (one bulk read), read on the pool while earlier groups are
being consumed, and put back in plan order. Handing TensorFlow a group of
batches at a time (split again inside tf.data) keeps the per-batch cost of
crossing from Python small.
"""

import os
from collections import deque

import numpy as np

from matex import timeline

from ._reader import SlabFull

_THROUGH = object()     # token of a group read bypassing the unit cache


def cpu_count():
    """CPUs this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def stream(reader, groups, make, submit, depth):
    """Yield ``make(fields, order, count)`` for each ``(rows, count)`` in ``groups``.

    ``fields`` are the group's rows read in sorted order; ``order`` is the
    position of each sorted row in the group (``argsort`` of ``rows``).
    """
    pending = deque()
    todo = iter(groups)
    held = None

    def job(rows, order, count, token):
        with timeline.span("read", rows=len(rows)):
            fields = reader.read(rows) if token is not _THROUGH else reader.read_through(rows)
        with timeline.span("decode", rows=len(rows)):
            return make(fields, order, count)

    def fill():
        nonlocal held
        while len(pending) < depth:
            if held is None:
                group = next(todo, None)
                if group is None:
                    return
                rows, count = group
                order = np.argsort(rows, kind="stable")
                held = rows[order], order, count
            try:
                token = reader.prefetch(held[0])
            except SlabFull:
                if pending:
                    return
                token = _THROUGH
            pending.append((submit(job, *held, token), token))
            held = None

    def release(token):
        if token is not _THROUGH:
            reader.release(token)

    try:
        fill()
        while pending:
            future, token = pending.popleft()
            try:
                batch = future.result()
            finally:
                release(token)
            fill()
            yield batch
    finally:
        while pending:
            future, token = pending.popleft()
            future.cancel()
            if not future.cancelled():
                future.exception()
            release(token)


def tf_dataset(generator, signature, steps):
    """A tf.data.Dataset of the ``steps`` batches in the groups ``generator()`` yields.

    ``signature`` describes one batch; the generator yields the same
    structure with a leading axis of batches. The dataset is marked as
    already sharded (a mark that survives later transformations, see
    ``matex._batch_slicing.mark_sharded``), and knows its length (so Keras
    does too).
    """
    import tensorflow as tf

    grouped = tf.nest.map_structure(
        lambda spec: tf.TensorSpec((None,) + tuple(spec.shape), spec.dtype), signature)
    dataset = tf.data.Dataset.from_generator(generator, output_signature=grouped)
    dataset = dataset.flat_map(
        lambda *group: tf.data.Dataset.from_tensor_slices(group[0] if len(group) == 1 else group))
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)
    from matex import _batch_slicing

    return _batch_slicing.mark_sharded(dataset)
