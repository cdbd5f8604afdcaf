"""Pass: the ``MatMulNBits`` gradient's ``GatherBlockQuantized`` becomes ops onnxruntime-web's WebGPU runs.

The derivative rule of ``MatMulNBits`` (:mod:`onnx_training_ops.autodiff.rules_quantized`)
dequantizes the weight with one ``GatherBlockQuantized`` of every row, its indices tied to the
gradient by an int64 zero. onnxruntime-web 1.30's WebGPU provider has no kernel for that (uint8
data; it falls back to the CPU), nor for int64 arithmetic. This pass writes the same ``[N, K']``
float weight with what WebGPU runs, straight from the packed weight ``B``:

    bytes  = DequantizeLinear(B, 1.0) + zero          # uint8 -> float, exact; zero: tied to the gradient
    T      = Floor(bytes[..., None] * [1, 2^-b, ..., 2^-8])   # the byte shifted right by 0, b, ..., 8 bits
    q      = T[..., :-1] - 2^b * T[..., 1:]           # the b-bit fields, low bits first
    weight = (q - zero_point) * scale                 # per block; zero_point 2^(b-1) when absent

(``zero`` is ``Cast(Less(g, g))`` of the gradient's first element ``g``: 0.0, and computed only
once the gradient is, as the rule's int64 zero was). Every step is exact in float32 but the last
product, which ``GatherBlockQuantized`` rounds alike. Only the rule's form (indices
``arange(N) + zero``) is rewritten; another ``GatherBlockQuantized`` (a quantized embedding's
lookup) is left to the provider. A weight the rule dequantizes by row ranges (``arange(start,
stop) + zero``) is written once whole, at its first range, and each range is a ``Slice`` of it (WebGPU
slices no uint8): the float weight of every row held through the ranges, as before ranges.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ._rewrite import Names

MS = "com.microsoft"


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class _Graph:
    def __init__(self, graph: onnx.GraphProto):
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.inits = {t.name: t for t in graph.initializer}

    def value(self, name: str, max_elements: int = 1 << 24) -> np.ndarray | None:
        """A small constant's value (initializer or Constant), else None."""
        if name in self.inits:
            t = self.inits[name]
            return numpy_helper.to_array(t) if int(np.prod(t.dims)) <= max_elements else None
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def source(self, name: str) -> str:
        """``name``, or the initializer a Reshape of it reads (the rule reshapes B and the scales)."""
        node = self.producer.get(name)
        if node is not None and node.op_type == "Reshape" and node.input[0] in self.inits:
            return node.input[0]
        return name

    def gate(self, indices: str, rows: int) -> tuple[str, int, int] | None:
        """The float the rule tied ``indices`` to (``arange(start, stop) + Cast(Less(g, g))``, a
        range of the ``rows``): ``g``, ``start`` and ``stop``."""
        add = self.producer.get(indices)
        if add is None or add.op_type != "Add":
            return None
        for const, other in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
            value = self.value(const)
            if value is None or value.ndim != 1 or not value.size:
                continue
            start, stop = int(value[0]), int(value[0]) + value.size
            if stop > rows or not np.array_equal(value, np.arange(start, stop)):
                continue
            cast = self.producer.get(other)
            less = self.producer.get(cast.input[0]) if cast is not None and cast.op_type == "Cast" else None
            if less is not None and less.op_type == "Less" and less.input[0] == less.input[1]:
                return less.input[0], start, stop
        return None


def dequantize_with_float_ops(model: ModelProto) -> ModelProto:
    """Rewrite the rule's ``GatherBlockQuantized`` nodes of the main graph (in place; returns ``model``)."""
    graph = model.graph
    if not any(n.op_type == "GatherBlockQuantized" and n.domain == MS for n in graph.node):
        return model
    g = _Graph(graph)
    names = Names(graph, "dequantize")
    nodes: list[onnx.NodeProto] = []
    replaced: list[onnx.NodeProto] = []
    whole: dict[tuple, str] = {}  # a weight dequantized by row ranges: its float rows, made once
    for node in graph.node:
        rewritten = _rewrite(node, g, names, whole) if node.op_type == "GatherBlockQuantized" and node.domain == MS \
            else None
        nodes.extend(rewritten if rewritten is not None else [node])
        if rewritten is not None:
            replaced.append(node)
    if replaced:
        nodes = _without_dead_cone(nodes, [i for node in replaced for i in node.input], graph)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _without_dead_cone(nodes: list[onnx.NodeProto], roots: list[str], graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """``nodes`` less those that computed only what the replaced nodes read (``roots``: the
    int64 indices and their gate, the Reshapes of B) and nothing reads now."""
    producer = {o: n for n in nodes for o in n.output if o}
    cone, work = set(), [r for r in roots if r in producer]
    while work:
        node = producer[work.pop()]
        if id(node) not in cone:
            cone.add(id(node))
            work.extend(i for i in node.input if i in producer)
    kept = list(nodes)
    while True:
        read = {i for n in kept for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in kept if id(n) in cone and not any(o in read for o in n.output if o)]
        if not dead:
            return kept
        gone = {id(n) for n in dead}
        kept = [n for n in kept if id(n) not in gone]


def _rewrite(node: onnx.NodeProto, g: _Graph, names: Names, whole: dict[tuple, str]) -> list[onnx.NodeProto] | None:
    attrs = _attrs(node)
    bits, block = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    data, scales = g.source(node.input[0]), node.input[2]
    zero_points = node.input[3] if len(node.input) > 3 and node.input[3] else None
    tensor = g.inits.get(data)
    if tensor is None or tensor.data_type != TensorProto.UINT8 or attrs.get("gather_axis", 0) != 0 \
            or bits not in (2, 4, 8):
        return None
    rows = int(tensor.dims[0])
    per_row = int(np.prod(tensor.dims[1:]))  # bytes
    if attrs.get("quantize_axis", 1) != 1 or (per_row * 8 // bits) % block:
        return None
    scale_tensor = g.inits.get(g.source(scales))
    if scale_tensor is None or scale_tensor.data_type != TensorProto.FLOAT:  # float32 arithmetic below
        return None
    tied = g.gate(node.input[1], rows)
    if tied is None:
        return None
    gradient, start, stop = tied
    blocks = per_row * 8 // bits // block
    out: list[onnx.NodeProto] = []
    if (start, stop) != (0, rows):  # a row range (WebGPU slices no uint8): of every row's float weight
        key = (data, scales, zero_points, bits, block)
        if key not in whole:
            made = _float_weight(g, names, node, gradient, data, scales, zero_points, bits, block, rows, blocks,
                                 names("whole"))
            if made is None:
                return None
            out.extend(made)
            whole[key] = made[-1].output[0]

        def node_(op_type: str, inputs: list[str], hint: str, output: str | None = None, **kw) -> str:
            name = output or names(hint)
            out.append(helper.make_node(op_type, inputs, [name], name=node.name if output else name, **kw))
            return name

        bounds = [node_("Constant", [], hint, value=numpy_helper.from_array(np.array([v], np.int64)))
                  for v, hint in ((start, "start"), (stop, "stop"), (0, "axis"))]
        zero = node_("Cast", [node_("Less", [gradient, gradient], "never")], "zero", to=TensorProto.FLOAT)
        node_("Add", [node_("Slice", [whole[key], *bounds], "rows"), zero], "", output=node.output[0])
        return out
    return _float_weight(g, names, node, gradient, data, scales, zero_points, bits, block, rows, blocks,
                         node.output[0])


def _float_weight(g: _Graph, names: Names, node: onnx.NodeProto, gradient: str, data: str, scales: str,
                  zero_points: str | None, bits: int, block: int, rows: int, blocks: int,
                  output: str) -> list[onnx.NodeProto] | None:
    """The nodes writing every row of the float weight into ``output``, once ``gradient`` exists."""
    out: list[onnx.NodeProto] = []

    def op(op_type: str, inputs: list[str], hint: str, **kw) -> str:
        name = names(hint)
        out.append(helper.make_node(op_type, inputs, [name], name=name, **kw))
        return name

    def const(value, hint: str) -> str:
        name = names(hint)
        out.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name)))
        return name

    zero = op("Cast", [op("Less", [gradient, gradient], "never")], "zero", to=TensorProto.FLOAT)
    one = const(np.array(1.0, np.float32), "one")

    def fields(packed: str, count: int) -> str:
        """``[rows, count]`` float fields of the uint8 ``packed`` (``count`` per row)."""
        values = op("Add", [op("DequantizeLinear", [packed, one], "bytes"), zero], "bytes")
        if bits == 8:
            return op("Reshape", [values, const(np.array([rows, count], np.int64), "shape")], "fields")
        per_byte = 8 // bits
        shifts = const(np.array([2.0 ** (-bits * i) for i in range(per_byte + 1)], np.float32), "shifts")
        t = op("Floor", [op("Mul", [op("Unsqueeze", [values, const(np.array([-1], np.int64), "axis")], "b"),
                                    shifts], "scaled")], "shifted")
        starts, ends, axes = (const(np.array([v], np.int64), h) for v, h in ((0, "start"), (1, "one"), (-1, "last")))
        low = op("Slice", [t, starts, const(np.array([per_byte], np.int64), "end"), axes], "low")
        high = op("Slice", [t, ends, const(np.array([per_byte + 1], np.int64), "end"), axes], "high")
        q = op("Sub", [low, op("Mul", [high, const(np.array(2.0 ** bits, np.float32), "base")], "carry")], "q")
        return op("Reshape", [q, const(np.array([rows, count], np.int64), "shape")], "fields")

    q = op("Reshape", [fields(data, blocks * block), const(np.array([rows, blocks, block], np.int64), "shape")], "q")
    if zero_points is None:
        zp = const(np.array(2.0 ** (bits - 1), np.float32), "zero_point")
    else:
        source = g.source(zero_points)
        zp_tensor = g.inits.get(source)
        if zp_tensor is None or zp_tensor.data_type != TensorProto.UINT8:
            return None
        count = int(np.prod(zp_tensor.dims)) // rows * (8 // bits)
        zp = op("Slice", [fields(source, count), const(np.array([0], np.int64), "start"),
                          const(np.array([blocks], np.int64), "end"), const(np.array([1], np.int64), "axis")], "zp")
        zp = op("Unsqueeze", [zp, const(np.array([-1], np.int64), "axis")], "zero_point")
    scale = op("Reshape", [scales, const(np.array([rows, blocks, 1], np.int64), "shape")], "scale")
    weight = op("Mul", [op("Sub", [q, zp], "centered"), scale], "weight")
    out.append(helper.make_node("Reshape", [weight, const(np.array([rows, blocks * block], np.int64), "shape")],
                                [output], name=names("dequantized") if output != node.output[0] else
                                node.name or names("dequantized")))
    return out
