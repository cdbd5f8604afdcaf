"""Pass: the exporters' GELU subgraphs -> one ``com.microsoft`` ``Gelu`` / ``FastGelu`` node.

torch exports ``F.gelu`` as ``x * (1 + erf(x / sqrt 2))`` times 0.5 (Div, Erf, Add, Mul,
Mul) and transformers' tanh form (GPT-2's ``gelu_new``) as eight nodes (Pow, Mul, Add, Mul,
Tanh, Add, Mul, Mul). onnxruntime fuses those into its ``Gelu``/``FastGelu`` kernels only
when nothing else reads the intermediate values, and a gradient reads them all: every one
then runs as a pass over the activation, forward and backward. Rewritten before the Gradient
is expanded, the forward is one onnxruntime kernel and its derivative rule
(:mod:`onnx_training_ops.autodiff.rules_activation`) reads ``x`` only.

Runs in the pipelines for onnxruntime (:data:`PASSES`, :data:`NATIVE_PASSES`), not in the
portable one: ``com.microsoft`` ops run in every onnxruntime but not in ``onnx.reference``.
A subgraph is rewritten only when its constants match (within float32 rounding) and no
intermediate value is read elsewhere or is a graph output; a model without a Gradient node is
left as it is.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, helper, numpy_helper

from ..schema import DOMAIN
from ..walk import model_graphs

MS_DOMAIN = "com.microsoft"
_SQRT2 = math.sqrt(2.0)
_TANH_SCALE = math.sqrt(2.0 / math.pi)


class _Graph:
    """Producers, consumers and scalar constants of one graph."""

    def __init__(self, graph: GraphProto):
        self.graph = graph
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self.values = {t.name: numpy_helper.to_array(t) for t in graph.initializer if _small(t.dims)}
        for n in graph.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1 \
                    and n.attribute[0].name == "value" and _small(n.attribute[0].t.dims):
                self.values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def const(self, name: str | None, value: float) -> bool:
        """``name`` (None: no value) is a one-element constant close to ``value``."""
        v = None if name is None else self.values.get(name)
        return v is not None and v.size == 1 and bool(np.isclose(float(v.reshape(-1)[0]), value, rtol=1e-6, atol=0))

    def only_use(self, name: str | None, op_type: str) -> onnx.NodeProto | None:
        """The one node reading ``name``, if it is a standard ``op_type`` and ``name`` is no graph output."""
        if name is None:
            return None
        readers = self.consumers.get(name, [])
        if len(readers) != 1 or name in self.outputs:
            return None
        node = readers[0]
        return node if node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def made_by(self, name: str | None, op_type: str) -> onnx.NodeProto | None:
        node = None if name is None else self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _small(dims) -> bool:
    return int(np.prod(dims, dtype=np.int64)) <= 1


def _other(node: onnx.NodeProto, name: str) -> str | None:
    """The input of a binary ``node`` that is not ``name`` (None if both are)."""
    a, b = node.input[0], node.input[1]
    return b if a == name else a if b == name else None


def _half_times_x(g: _Graph, start: str, x: str) -> tuple[list, str] | None:
    """``start * x * 0.5`` by single-use Muls in any association: (nodes, result)."""
    first = g.only_use(start, "Mul")
    if first is None:
        return None
    factor = _other(first, start)
    if factor == x:  # (start * x) * 0.5
        second = g.only_use(first.output[0], "Mul")
        if second is not None and g.const(_other(second, first.output[0]), 0.5):
            return [first, second], second.output[0]
        return None
    half = g.made_by(factor, "Mul")  # start * (x * 0.5)
    if half is not None and g.only_use(factor, "Mul") is first and x in half.input and \
            g.const(_other(half, x), 0.5):
        return [half, first], first.output[0]
    return None


def _erf_gelu(g: _Graph, erf: onnx.NodeProto) -> tuple[list, str, str, str] | None:
    scaled = erf.input[0]
    div = g.made_by(scaled, "Div")
    mul = g.made_by(scaled, "Mul")
    if div is not None and g.const(div.input[1], _SQRT2):
        x, first = div.input[0], div
    elif mul is not None and g.const(mul.input[1], 1 / _SQRT2):
        x, first = mul.input[0], mul
    elif mul is not None and g.const(mul.input[0], 1 / _SQRT2):
        x, first = mul.input[1], mul
    else:
        return None
    add = g.only_use(erf.output[0], "Add")
    if g.only_use(scaled, "Erf") is not erf or add is None or not g.const(_other(add, erf.output[0]), 1.0):
        return None
    tail = _half_times_x(g, add.output[0], x)
    if tail is None:
        return None
    return [first, erf, add, *tail[0]], x, tail[1], "Gelu"


def _tanh_gelu(g: _Graph, tanh: onnx.NodeProto) -> tuple[list, str, str, str] | None:
    scale = g.made_by(tanh.input[0], "Mul")
    if scale is None or g.only_use(tanh.input[0], "Tanh") is not tanh:
        return None
    inner = next((i for i in scale.input if not g.const(i, _TANH_SCALE)), None)
    if inner is None or not g.const(_other(scale, inner), _TANH_SCALE):
        return None
    add = g.made_by(inner, "Add")
    if add is None or g.only_use(inner, "Mul") is not scale:
        return None
    for x, cubic in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
        times = g.made_by(cubic, "Mul")
        if times is None or g.only_use(cubic, "Add") is not add:
            continue
        cube = next((i for i in times.input if not g.const(i, 0.044715)), None)
        power = g.made_by(cube, "Pow")
        if cube is None or power is None or power.input[0] != x or not g.const(power.input[1], 3.0) or \
                not g.const(_other(times, cube), 0.044715) or g.only_use(cube, "Mul") is not times:
            continue
        plus = g.only_use(tanh.output[0], "Add")
        if plus is None or not g.const(_other(plus, tanh.output[0]), 1.0):
            return None
        tail = _half_times_x(g, plus.output[0], x)
        if tail is None:
            return None
        return [power, times, add, scale, tanh, plus, *tail[0]], x, tail[1], "FastGelu"
    return None


def _matches(graph: GraphProto) -> list[tuple]:
    """The GELU subgraphs of ``graph``: (nodes, x, y, fused op type) each."""
    g = _Graph(graph)
    found = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        match = _erf_gelu(g, node) if node.op_type == "Erf" else \
            _tanh_gelu(g, node) if node.op_type == "Tanh" else None
        if match is not None:
            found.append(match)
    return found


def _rewrite(graph: GraphProto, matches: list[tuple], types: dict) -> None:
    """Each match replaced by one node (its output typed as before, for shape inference,
    which stops at a com.microsoft node)."""
    drop = {id(n) for nodes, *_ in matches for n in nodes}
    last = {id(nodes[-1]): (x, y, op, nodes[-1].name) for nodes, x, y, op in matches}
    kept = []
    for node in graph.node:
        if id(node) in last:
            x, y, op, name = last[id(node)]
            kept.append(helper.make_node(op, [x], [y], name=f"{name or y}/fused_{op}", domain=MS_DOMAIN))
        elif id(node) not in drop:
            kept.append(node)
    read = {i for n in kept for i in n.input} | {o.name for o in graph.output}
    kept = [n for n in kept if not (n.op_type == "Constant" and n.output[0] not in read)]  # the matched constants
    del graph.node[:]
    graph.node.extend(kept)
    have = {v.name for v in graph.value_info}
    graph.value_info.extend(types[y] for _, _, y, _ in matches if y in types and y not in have)


def fuse_gelu(model: ModelProto) -> ModelProto:
    """Rewrite the GELU subgraphs of every graph of ``model`` (in place; returns it), when
    the model has a Gradient node (an inference model is left as it is)."""
    graphs = list(model_graphs(model))
    if not any(n.op_type == "Gradient" and n.domain == DOMAIN for g in graphs for n in g.node):
        return model
    found = [(graph, _matches(graph)) for graph in graphs]
    if not any(matches for _, matches in found):
        return model
    types = _value_infos(model)
    for graph, matches in found:
        if matches:
            _rewrite(graph, matches, types)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return model


def _value_infos(model: ModelProto) -> dict:
    """Value infos of ``model`` (shape-inferred before the rewrite, data propagated)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is an aid
        return {}
    return {v.name: v for g in model_graphs(inferred) for v in list(g.value_info) + list(g.output)
            if v.type.tensor_type.HasField("shape")}
