"""Gradient fusion: which gradients share one allreduce, and in what order.

Gradients are taken in reverse order of their variables (backprop produces
the last layers' gradients first) and packed, per dtype, into buckets of at
most ``threshold`` bytes; each bucket is one fused allreduce. Inside
``tf.function`` a bucket's allreduce depends only on its own gradients (plus
the previous collective, for ordering), so it starts while backprop is still
computing the earlier layers' gradients.
"""


from matex import _collectives, _config, _state

fusion_threshold = _config.fusion_threshold

# Fused op's node name -> the names of the tensors in its bucket, recorded when
# a graph is built (nothing per step): the timeline labels each fused
# collective with them.
bucket_names = _state.table("fusion.bucket_names", lifetime="session")


def _nbytes(t):
    n = t.shape.num_elements()
    return None if n is None else n * t.dtype.size


def plan_buckets(tensors, threshold):
    """Indices of ``tensors`` grouped into buckets, in the order to reduce them."""
    buckets, current, current_bytes, current_dtype = [], [], 0, None
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        nbytes = _nbytes(t)
        fits = (nbytes is not None and current and t.dtype == current_dtype
                and current_bytes + nbytes <= threshold)
        if not fits and current:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_dtype = t.dtype
        current_bytes += nbytes or 0
        if nbytes is None or threshold == 0:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def allreduce_gradients(grads, op="average", threshold=None, names=None):
    """Reduce a list of gradients over ranks; ``None`` entries stay ``None``.

    ``names``: one name per gradient (its variable's), for the timeline's
    view of each fused bucket; default the gradient tensors' names.
    """
    if threshold is None:
        threshold = fusion_threshold()
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [_collectives._as_tensor(grads[i], "allreduce") for i in present]
    out = list(grads)
    for bucket in plan_buckets(dense, threshold):
        if len(bucket) == 1:
            reduced = [_collectives.allreduce(dense[bucket[0]], op)]
        else:
            reduced = _collectives.grouped_allreduce([dense[j] for j in bucket], op)
            _remember_bucket(reduced, [names[present[j]] if names else None for j in bucket],
                             [dense[j] for j in bucket])
        for j, r in zip(bucket, reduced):
            out[present[j]] = r
    return out


def _remember_bucket(reduced, names, tensors):
    """Record the bucket's tensor names under its op's node name (graph mode only)."""
    op = getattr(reduced[0], "op", None) if reduced else None
    node = getattr(op, "name", None) if op is not None else None
    if not node:
        return   # eager: no node name to look up
    bucket_names[node] = [n or getattr(t, "name", "?") for n, t in zip(names, tensors)]
