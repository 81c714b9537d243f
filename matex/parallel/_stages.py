"""Cutting a Keras model into pipeline stages: marking, checking, balancing.

Three ways to say where the stages begin (``plan``):

* ``StageBoundary()`` layers in the model (Sequential or functional): each
  one starts a new stage; the tensor entering it is what crosses between
  the stages. Outside a pipeline it is an identity layer, so the model runs
  unchanged in one process.
* ``stages=["name", ...]``: the names of the *first layer of every stage
  after the first*; the tensor entering that layer crosses. (Naming a
  ``StageBoundary`` layer is the same thing.)
* ``stages=P``: MaTEx picks the P - 1 cuts itself (built models only),
  balancing the stages' cost = mean of their share of the parameters and
  their share of one batch's forward time (measured on rank 0, so every
  rank gets the same plan).

A cut must separate the graph: the tensor entering the cut layer must be the
only one crossing it. A residual branch that jumps over a boundary (a tensor
made before it and used after it) cannot be cut; that is a ``ValueError``
naming both layers. Nested models are treated as one layer; a layer called
more than once (shared weights) is refused.
"""

from __future__ import annotations

import time

import keras
import tensorflow as tf
import numpy as np

from matex import _compat
from matex._everywhere import on_root


@keras.saving.register_keras_serializable(package="matex")
class StageBoundary(keras.layers.Layer):
    """Marks where a new pipeline stage begins; an identity layer everywhere else.

    Its input is the tensor sent from one stage to the next. Models saved by
    ``PipelineModel.save`` have it replaced by ``keras.layers.Identity``, so
    they load without MaTEx.
    """

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        return inputs

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return input_shape


class Plan:
    """Where the stages of one model begin.

    ``starts[k]``: the name of the first layer of stage k (``None`` for
    stage 0). ``stage_layers[k]``: names of the layers of stage k, in order.
    ``built``: whether the model's graph exists (else: an unbuilt Sequential).
    """

    def __init__(self, starts, stage_layers, built):
        self.starts = starts
        self.stage_layers = stage_layers
        self.built = built

    @property
    def size(self):
        return len(self.starts)

    def __repr__(self):
        return "Plan(%s)" % " | ".join(", ".join(s) for s in self.stage_layers)


def is_unbuilt_sequential(model):
    return isinstance(model, keras.Sequential) and not model.built


def _layers(model):
    """The model's layers in topological order (input layers excluded)."""
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def _check_called_once(layers):
    for layer in layers:
        nodes = len(_compat.inbound_nodes(layer))
        if nodes > 1:
            raise ValueError(
                "matex.parallel: layer %r is called %d times (shared weights); a pipelined "
                "model must call each layer once" % (layer.name, nodes))


class _Graph:
    """Producer/consumer edges between the layers of a built model (public attributes only)."""

    def __init__(self, model):
        self.model = model
        self.layers = _layers(model)
        _check_called_once(self.layers)
        self.producer = {}   # id(KerasTensor) -> index of the layer making it; -1 = model input
        for t in model.inputs:
            self.producer[id(t)] = -1
        for i, layer in enumerate(self.layers):
            for t in keras.tree.flatten(layer.output):
                self.producer[id(t)] = i
        self.inputs = []     # per layer: indices of the producers of its inputs
        for layer in self.layers:
            self.inputs.append([self.producer.get(id(t), -1)
                                for t in keras.tree.flatten(layer.input)])
        self.outputs = [self.producer.get(id(t), -1) for t in model.outputs]


def _assign(graph, cut_names):
    """Stage index of every layer; ValueError if a cut does not separate the graph."""
    stage = []
    for i, layer in enumerate(graph.layers):
        before = max([stage[j] if j >= 0 else 0 for j in graph.inputs[i]] or [0])
        stage.append(before + 1 if layer.name in cut_names else before)
    for i, layer in enumerate(graph.layers):
        for j in graph.inputs[i]:
            source = stage[j] if j >= 0 else 0
            name = graph.layers[j].name if j >= 0 else "the model input"
            cut = layer.name in cut_names
            if stage[i] == source or (cut and stage[i] == source + 1
                                      and len(graph.inputs[i]) == 1):
                continue
            if cut and len(graph.inputs[i]) != 1:
                raise ValueError(
                    "matex.parallel: stage boundary %r has %d inputs; a cut must take exactly "
                    "one tensor" % (layer.name, len(graph.inputs[i])))
            raise ValueError(
                "matex.parallel: the stage boundaries do not separate the model: layer %r "
                "(stage %d) uses the output of %s (stage %d); a residual or skip connection "
                "crosses a boundary (the cut before %r?). Put the boundary where a single "
                "tensor connects the two parts."
                % (layer.name, stage[i], "layer %r" % name if j >= 0 else name, source,
                   _cut_between(graph, stage, source, stage[i], cut_names)))
    last = max(stage) if stage else 0
    for j in graph.outputs:
        if (stage[j] if j >= 0 else 0) != last:
            raise ValueError(
                "matex.parallel: model output %s belongs to stage %d, not to the last stage "
                "%d: every output must come from the last stage"
                % ("of layer %r" % graph.layers[j].name if j >= 0 else "(an input)",
                   stage[j] if j >= 0 else 0, last))
    return stage


def _cut_between(graph, stage, lo, hi, cut_names):
    for i, layer in enumerate(graph.layers):
        if layer.name in cut_names and lo < stage[i] <= hi:
            return layer.name
    return "?"


def _plan_from_cuts(model, cut_names, pipeline_size):
    cut_names = list(cut_names)
    names = [layer.name for layer in _layers(model)]
    missing = [n for n in cut_names if n not in names]
    if missing:
        raise ValueError("matex.parallel: stages names layers the model does not have: %s "
                         "(layers: %s)" % (", ".join(map(repr, missing)), ", ".join(names)))
    if len(set(cut_names)) != len(cut_names):
        raise ValueError("matex.parallel: a layer is named twice in stages=%r" % (cut_names,))
    stages = len(cut_names) + 1
    if pipeline_size is not None and stages != pipeline_size:
        raise ValueError(
            "matex.parallel: the model has %d stages (%d boundaries) but the pipeline has %d "
            "ranks; they must be equal" % (stages, len(cut_names), pipeline_size))
    if is_unbuilt_sequential(model):
        order = sorted(cut_names, key=names.index)
        if order != cut_names and any(not isinstance(model.get_layer(n), StageBoundary)
                                      for n in cut_names):
            raise ValueError("matex.parallel: stages=%r must list the layers in model order"
                             % (cut_names,))
        bounds = [0] + [names.index(n) for n in order] + [len(names)]
        groups = [names[a:b] for a, b in zip(bounds, bounds[1:])]
        starts = [None] + order
        built = False
    else:
        graph = _Graph(model)
        stage = _assign(graph, set(cut_names))
        groups = [[] for _ in range(stages)]
        starts = [None] * stages
        for layer, s in zip(graph.layers, stage):
            groups[s].append(layer.name)
            if layer.name in cut_names:
                starts[s] = layer.name
        built = True
    for k, group in enumerate(groups):
        if not [n for n in group if not isinstance(model.get_layer(n), StageBoundary)]:
            raise ValueError(
                "matex.parallel: stage %d has no layers (%d stages for %d layers): more stages "
                "than the model can be cut into" % (k, stages, len(names)))
    return Plan(starts, groups, built)


def _valid_cuts(graph):
    """Indices i such that cutting before layer i crosses one tensor, which layer i takes."""
    n = len(graph.layers)
    last_use = {}   # producer index -> last consumer index (outputs: n)
    for i in range(n):
        for j in graph.inputs[i]:
            last_use[j] = max(last_use.get(j, -1), i)
    for j in graph.outputs:
        last_use[j] = n
    cuts = []
    for i in range(1, n):
        crossing = [j for j, last in last_use.items() if j < i and last >= i]
        if len(crossing) == 1 and graph.inputs[i] == crossing \
                and all(j == crossing[0] for j in graph.inputs[i]):
            cuts.append(i)
    return cuts


def layer_costs(model, batch_size=32, repeats=3):
    """(parameters, seconds of one forward call) per layer, measured on random data."""
    graph = _Graph(model)
    values = {}
    for t in model.inputs:
        shape = [batch_size if d is None else d for d in t.shape]
        values[id(t)] = keras.random.uniform(shape, dtype=t.dtype) if "float" in str(t.dtype) \
            else keras.ops.zeros(shape, dtype=t.dtype)
    params, seconds = [], []
    for layer in graph.layers:
        args = keras.tree.map_structure(lambda t: values[id(t)], layer.input)
        out = layer(args)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = layer(args)
            np.asarray(keras.tree.flatten(out)[0])   # wait for the result
            best = min(best, time.perf_counter() - start)
        for t, v in zip(keras.tree.flatten(layer.output), keras.tree.flatten(out)):
            values[id(t)] = v
        params.append(int(sum(np.prod(w.shape) for w in layer.weights)))
        seconds.append(best)
    return params, seconds


def balance(costs, cuts, stages):
    """Pick ``stages - 1`` cut indices from ``cuts`` minimising the costliest stage.

    ``costs[i]``: cost of layer i. Exact dynamic programme over the allowed cut
    positions (models have at most thousands of layers).
    """
    n = len(costs)
    points = [0] + sorted(cuts) + [n]
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def seg(a, b):
        return prefix[points[b]] - prefix[points[a]]

    m = len(points)
    inf = float("inf")
    best = [[inf] * m for _ in range(stages + 1)]
    back = [[-1] * m for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for b in range(1, m):
            for a in range(b):
                if best[k - 1][a] == inf:
                    continue
                value = max(best[k - 1][a], seg(a, b))
                if value < best[k][b]:
                    best[k][b], back[k][b] = value, a
    if best[stages][m - 1] == inf:
        return None
    chosen, b = [], m - 1
    for k in range(stages, 0, -1):
        a = back[k][b]
        if a > 0:
            chosen.append(points[a])
        b = a
    return sorted(chosen)


def _plan_balanced(model, stages, measure):
    if is_unbuilt_sequential(model):
        raise ValueError("matex.parallel: stages=%d balances by measured cost and needs a "
                         "built model; build it, or mark the stages with StageBoundary layers "
                         "or stages=[layer names]" % stages)
    graph = _Graph(model)
    if stages > len(graph.layers):
        raise ValueError("matex.parallel: %d stages for a model of %d layers: more stages "
                         "than layers" % (stages, len(graph.layers)))
    cuts = _valid_cuts(graph)
    if stages - 1 > len(cuts):
        raise ValueError(
            "matex.parallel: the model can be cut in at most %d places (where a single tensor "
            "connects the parts), too few for %d stages" % (len(cuts), stages))
    params, seconds = measure(model)
    p = np.asarray(params, float)
    s = np.asarray(seconds, float)
    cost = 0.5 * p / max(p.sum(), 1.0) + 0.5 * s / max(s.sum(), 1e-12)
    chosen = balance(cost, cuts, stages)
    return _plan_from_cuts(model, [graph.layers[i].name for i in chosen], stages)


def plan(model, stages, pipeline_size, measure=layer_costs, agree=None):
    """The stage plan for ``model`` (see ``_plan``). On a 1-rank pipeline the
    marked cuts are checked and the whole model is one stage (boundaries are
    identities), so a pipelined script also runs in one process."""
    if pipeline_size == 1 and not isinstance(stages, (int, np.integer)):
        marked = _plan(model, stages, None, measure, agree)
        return Plan([None], [[n for group in marked.stage_layers for n in group]],
                    marked.built)
    return _plan(model, stages, pipeline_size, measure, agree)


def _plan(model, stages, pipeline_size, measure=layer_costs, agree=None):
    """The stage plan for ``model``; with ``agree`` (a communicator) every rank uses its
    rank 0's balanced choice (collective), an error there a ValueError everywhere.

    Args:
      stages: None (use the model's ``StageBoundary`` layers), a list of layer
        names (first layer of each stage after the first) or an int.
      pipeline_size: the number of pipeline ranks the plan must match (None: any).
    """
    if not isinstance(model, keras.Model):
        raise TypeError("matex.parallel: PipelineModel needs a keras.Model, got %r" % (model,))
    if not is_unbuilt_sequential(model) and not getattr(model, "inputs", None):
        raise ValueError("matex.parallel: the model has no inputs yet: give the Sequential "
                         "a keras.Input, or build the model before pipelining it")
    if stages is None:
        cuts = [layer.name for layer in _layers(model) if isinstance(layer, StageBoundary)]
        if not cuts and pipeline_size not in (None, 1):
            raise ValueError(
                "matex.parallel: the model has no StageBoundary layer and no stages= was given, "
                "but the pipeline has %d ranks" % pipeline_size)
        return _plan_from_cuts(model, cuts, pipeline_size)
    if isinstance(stages, (int, np.integer)) and not isinstance(stages, bool):
        if pipeline_size is not None and stages != pipeline_size:
            raise ValueError("matex.parallel: stages=%d but the pipeline has %d ranks; they "
                             "must be equal" % (stages, pipeline_size))
        if stages < 1:
            raise ValueError("matex.parallel: stages must be >= 1, not %d" % stages)
        def choose():
            return _plan_balanced(model, int(stages), measure).starts[1:]

        # rank 0 measures and chooses; any error there is raised on every rank
        names = choose() if agree is None else on_root(agree, choose, error_type=ValueError)
        return _plan_from_cuts(model, names, pipeline_size)
    if isinstance(stages, (list, tuple)) and all(isinstance(s, str) for s in stages):
        return _plan_from_cuts(model, stages, pipeline_size)
    raise TypeError("matex.parallel: stages must be None, an int or a list of layer names, "
                    "not %r" % (stages,))
