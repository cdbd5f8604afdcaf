"""Pass: the MaxPool gradient without MaxPool's Indices output (non-overlapping 2-D windows).

The MaxPool derivative rule (:mod:`onnx_training_ops.autodiff.rules_nn`) scatter-adds the
gradient to the positions MaxPool's second output (Indices, int64) names: ``Reshape(Indices,
[-1])`` into ``ScatterElements(zeros, ., Reshape(g, [-1]), axis=0, reduction="add")``.
onnxruntime-web's WebGPU MaxPool has no Indices output (1.30: "The Indices output is not
supported yet", at run time) and runs no int64 arithmetic. When the windows tile the input
(kernel == strides, no padding, no dilation, the spatial dims divisible by the kernel, static
shapes), each input element lies in exactly one window and the scatter is a mask: the windows
laid out as a last axis (Reshape, Transpose, Reshape), the first position holding the window's
maximum (Equal, Where over a float range, ReduceMin: MaxPool's Indices name the first maximum
in row-major order) gets the window's gradient, the others zero; laid back out and flattened,
that is the ScatterElements' output exactly. Any other MaxPool whose Indices are read is refused.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import ModelProto, helper

from ..errors import TrainingOpError, node_label
from ._rewrite import Names, constant, opset


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _tiles(node: onnx.NodeProto, shape: list[int] | None) -> tuple[int, int] | None:
    a = _attrs(node)
    kernel = list(a.get("kernel_shape", []))
    if shape is None or len(shape) != 4 or len(kernel) != 2:
        return None
    if (list(a.get("strides", kernel)) != kernel or any(a.get("pads", [0] * 4))
            or any(d != 1 for d in a.get("dilations", [1, 1]))):
        return None
    if a.get("ceil_mode", 0) or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID") \
            or a.get("storage_order", 0):
        return None
    if shape[2] % kernel[0] or shape[3] % kernel[1]:
        return None
    return kernel[0], kernel[1]


def _reduce(op: str, x: str, out: str, version: int, names: Names) -> list:
    if version >= 18:
        node, axes = constant(names, "axes", np.array([-1], np.int64))
        return [node, helper.make_node(op, [x, axes], [out], keepdims=1)]
    return [helper.make_node(op, [x], [out], axes=[-1], keepdims=1)]


def _emitters(out: list, names: Names):
    """``const(hint, value)`` and ``op(op_type, inputs, **attrs)``: append a node to ``out``, return its output."""

    def const(hint: str, value: np.ndarray) -> str:
        node, name = constant(names, hint, value)
        out.append(node)
        return name

    def op(op_type: str, inputs: list[str], **attrs) -> str:
        name = names(op_type.lower())
        out.append(helper.make_node(op_type, inputs, [name], **attrs))
        return name

    return const, op


def maxpool_gradient_by_mask(model: ModelProto) -> ModelProto:
    """Rewrite each MaxPool gradient scatter as a mask (in place; returns ``model``).

    Args:
        model: the step model, its data inputs' shapes static.

    Returns:
        ``model``.

    Raises:
        TrainingOpError: a MaxPool whose Indices are read other than by the gradient's scatter,
            or whose windows do not tile its input.
    """
    graph = model.graph
    pools = [n for n in graph.node if n.op_type == "MaxPool" and len(n.output) > 1 and n.output[1]]
    if not pools:
        return model
    inferred = onnx.shape_inference.infer_shapes(model).graph
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in (*inferred.input, *inferred.value_info) if vi.type.tensor_type.HasField("shape")}
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in (*inferred.input, *inferred.value_info)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    producer = {o: n for n in graph.node for o in n.output}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    version = opset(model)
    names = Names(graph, "maxpool_grad")
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for pool in pools:
        x = pool.input[0]
        shape = shapes.get(x)
        static = [d for d in shape or [] if d is not None]
        tiles = _tiles(pool, static if shape and len(static) == len(shape) else None)
        flats = readers.get(pool.output[1], [])
        scatters = [s for f in flats if f.op_type == "Reshape" for s in readers.get(f.output[0], [])]
        if tiles is None or not flats or any(f.op_type != "Reshape" for f in flats) or \
                any(s.op_type != "ScatterElements" or s.input[1] != f.output[0]
                    for f in flats for s in readers.get(f.output[0], [])):
            raise TrainingOpError(f"maxpool_gradient_by_mask: {node_label(pool)}: its Indices output is read, which "
                                  "WebGPU's MaxPool does not give; only the gradient of a MaxPool whose windows tile "
                                  f"its input (kernel == strides, no pads, static shape {shape}) is rewritten")
        n, c, h, w = static
        kh, kw = tiles
        oh, ow = h // kh, w // kw
        for scatter in scatters:
            flat_g = producer.get(scatter.input[2])
            if flat_g is None or flat_g.op_type != "Reshape":
                raise TrainingOpError(f"maxpool_gradient_by_mask: {node_label(scatter)} "
                                      "does not scatter a reshaped gradient")
            g = flat_g.input[0]
            out: list[onnx.NodeProto] = []
            const, op = _emitters(out, names)
            windows = op("Reshape", [x, const("shape", np.array([n, c, oh, kh, ow, kw], np.int64))])
            windows = op("Transpose", [windows], perm=[0, 1, 2, 4, 3, 5])
            windows = op("Reshape", [windows, const("shape", np.array([n, c, oh, ow, kh * kw], np.int64))])
            top = names("max")
            out += _reduce("ReduceMax", windows, top, version, names)
            positions = const("range", np.arange(kh * kw, dtype=np.float32))
            candidates = op("Where", [op("Equal", [windows, top]), positions,
                                      const("past", np.array(kh * kw, np.float32))])
            first = names("first")
            out += _reduce("ReduceMin", candidates, first, version, names)
            hit = op("Equal", [positions, first])
            grad = op("Reshape", [g, const("shape", np.array([n, c, oh, ow, 1], np.int64))])
            zero = const("zero", np.array(0, helper.tensor_dtype_to_np_dtype(elem.get(g, onnx.TensorProto.FLOAT))))
            spread = op("Where", [hit, grad, zero])
            spread = op("Reshape", [spread, const("shape", np.array([n, c, oh, ow, kh, kw], np.int64))])
            spread = op("Transpose", [spread], perm=[0, 1, 2, 4, 3, 5])
            out.append(helper.make_node("Reshape", [spread, const("shape", np.array([-1], np.int64))],
                                        [scatter.output[0]], name=scatter.name))
            replace[id(scatter)] = out
        drop.update(id(f) for f in flats)
        pool.output[1] = ""
        while pool.output and not pool.output[-1]:
            pool.output.pop()
    nodes = []
    for node in graph.node:
        if id(node) in drop:
            continue
        nodes.extend(replace.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    return model
