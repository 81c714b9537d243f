"""``ensemble(models, weights)``: one Keras model that averages its members' outputs.

The usual end of a search: ``ensemble(tuner.get_best_models(k))``. The result
is an ordinary functional ``keras.Model`` whose members are nested models fed
the same inputs, and whose output is the (weighted) mean of their outputs as
they are: members ending in a softmax give averaged probabilities.

Why only built-in Keras layers (``Average``, or ``Rescaling`` + ``Add`` for
weights) and no class of MaTEx's own: a ``.keras`` file of the ensemble then
loads with plain ``keras.saving.load_model`` in any process, with no
``custom_objects`` and without MaTEx installed.

Being a plain model, it is distributed like any other under ``import
matex.keras`` or ``python -m matex``: ``evaluate`` and ``predict`` split the
rows over the ranks and give exact global results on every rank. The members'
forward passes are not spread over ranks (every rank runs every member on its
share of the rows): under data-parallel evaluation the ranks hold different
rows, so a member computed on one rank would be missing on the others'.
"""

import math
from numbers import Real
from typing import Optional, Sequence

import keras


def ensemble(models: Sequence[keras.Model], weights: Optional[Sequence[float]] = None,
             trainable: bool = False, name: str = "ensemble") -> keras.Model:
    """One model whose output is the weighted mean of ``models``' outputs.

    ``models``: at least one built Keras model (functional or ``Sequential``
    with an ``Input``), all with the same input and output shapes and dtypes.
    ``weights``: one positive number per model, normalised to sum 1 (default:
    equal weights, a plain mean). ``trainable``: the members are frozen by
    default, as an ensemble is for inference; ``True`` leaves their
    ``trainable`` flags as they are.

    The members are used, not copied: freezing sets their ``trainable`` to
    False, and a member whose name another member already has is renamed
    (``name_2``, ...), since a Keras model needs distinct layer names. The
    returned model is not compiled: compile it with the loss and metrics to
    ``evaluate``.
    """
    models = _check_models(models)
    scales = _normalised(weights, len(models))
    first = models[0]
    inputs = [keras.Input(shape=tuple(t.shape)[1:], dtype=t.dtype) for t in first.inputs]
    feed = inputs[0] if len(inputs) == 1 else inputs
    _distinct_names(models)
    outputs = []
    for model in models:
        if not trainable:
            model.trainable = False
        outputs.append(model(feed))
    leaves = [keras.tree.flatten(out) for out in outputs]
    averaged = [_average([member[i] for member in leaves], scales, "%s_output_%d" % (name, i))
                for i in range(len(leaves[0]))]
    return keras.Model(inputs=feed, outputs=keras.tree.pack_sequence_as(outputs[0], averaged),
                       name=name)


def _check_models(models):
    """The members as a list, after checking they are models of one signature."""
    if isinstance(models, keras.Model) or not isinstance(models, (list, tuple)):
        raise TypeError("ensemble() takes a list of Keras models (e.g. "
                        "tuner.get_best_models(k)), not %s" % type(models).__name__)
    models = list(models)
    if not models:
        raise ValueError("ensemble() needs at least one model, got an empty list")
    signatures = []
    for i, model in enumerate(models):
        if not isinstance(model, keras.Model):
            raise TypeError("ensemble(): member %d is a %s, not a keras.Model"
                            % (i, type(model).__name__))
        signatures.append(_signature(i, model))
    for i, signature in enumerate(signatures[1:], 1):
        for what, mine, theirs in zip(("inputs", "outputs"), signature, signatures[0]):
            if mine != theirs:
                raise ValueError("ensemble(): member %d's %s %s differ from member 0's %s; "
                                 "every member must take the same inputs and give outputs "
                                 "of the same shapes" % (i, what, _show(mine), _show(theirs)))
    return models


def _signature(i, model):
    """((shape, dtype) of each input, (shape, dtype) of each output) of a built model."""
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise ValueError("ensemble(): member %d (%r) has no defined inputs and outputs; "
                         "members must be built functional models or Sequential models "
                         "starting with keras.Input" % (i, model.name))
    return tuple(tuple((tuple(t.shape), str(t.dtype)) for t in ts) for ts in (inputs, outputs))


def _show(tensors):
    return ", ".join("%s %s" % (shape, dtype) for shape, dtype in tensors)


def _normalised(weights, count):
    """The members' weights summing to 1, or None for equal weights."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
        raise TypeError("ensemble(): weights must be a list of numbers, one per model, "
                        "not %s" % type(weights).__name__)
    weights = list(weights)
    if len(weights) != count:
        raise ValueError("ensemble(): %d weights for %d models; give one weight per model"
                         % (len(weights), count))
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w) or w <= 0:
            raise ValueError("ensemble(): weight %d is %r; weights must be finite numbers "
                             "> 0 (leave a member out rather than give it weight 0)" % (i, w))
    total = math.fsum(float(w) for w in weights)
    return [float(w) / total for w in weights]


def _average(tensors, scales, name):
    """Mean of ``tensors`` (``scales`` None) or their sum weighted by ``scales``."""
    if len(tensors) == 1:
        return tensors[0]
    if scales is None:
        return keras.layers.Average(name=name)(tensors)
    scaled = [keras.layers.Rescaling(scale, name="%s_weight_%d" % (name, i))(t)
              for i, (t, scale) in enumerate(zip(tensors, scales))]
    return keras.layers.Add(name=name)(scaled)


def _distinct_names(models):
    """Rename members whose name an earlier member has (a model's layer names are unique)."""
    taken = set()
    done = set()
    for model in models:
        if id(model) in done:
            continue
        done.add(id(model))
        name, n = model.name, 1
        while name in taken:
            n += 1
            name = "%s_%d" % (model.name, n)
        if name != model.name:
            model.name = name
        taken.add(name)
