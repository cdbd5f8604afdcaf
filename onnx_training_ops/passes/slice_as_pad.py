"""Pass: a ``Slice`` of int32 data becomes a ``Pad`` with negative pads.

onnxruntime-web's WebGPU execution provider registers ``Slice`` for float types only (1.30: an
int32 Slice falls back to the CPU) but ``Pad`` for int32 too, and a negative pad crops:
``Slice(x, starts, ends, axes)`` with unit steps is ``Pad(x, [-start_i ...] + [end_i - dim_i ...])``.
A causal LM's label shift (``labels[:, 1:]``) is such a Slice. Rewritten: Slices of int32 or
uint32 data of static shape whose starts, ends and axes are constants and whose steps are all 1;
any other Slice is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ._rewrite import Names, constants, opset

_TYPES = (TensorProto.INT32, TensorProto.UINT32)


def _static(model: ModelProto) -> dict[str, tuple[int, list[int]]]:
    """Element type and shape of every value whose shape is static."""
    g = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    found = {}
    for vi in (*g.input, *g.output, *g.value_info):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            found[vi.name] = (tt.elem_type, [d.dim_value for d in tt.shape.dim])
    return found


def _pads(node, shape: list[int], known: dict) -> list[int] | None:
    """The Pad's pads for ``node``, or None when it is not a unit-step crop of constants."""
    args = [known.get(name) if name else None for name in node.input[1:5]]
    starts, ends = args[0], args[1]
    if starts is None or ends is None or (len(node.input) > 3 and node.input[3] and args[2] is None) \
            or (len(node.input) > 4 and node.input[4] and args[3] is None):
        return None
    rank = len(shape)
    axes = args[2] if len(args) > 2 and args[2] is not None else np.arange(len(starts))
    steps = args[3] if len(args) > 3 and args[3] is not None else np.ones(len(starts), np.int64)
    if not np.all(steps == 1):
        return None
    begin, end = [0] * rank, [0] * rank
    for axis, start, stop in zip(axes.tolist(), starts.tolist(), ends.tolist()):
        axis += rank if axis < 0 else 0
        dim = shape[axis]
        start = min(max(start + dim if start < 0 else start, 0), dim)  # ONNX Slice's clamping
        stop = min(max(stop + dim if stop < 0 else stop, 0), dim)
        if stop < start:
            return None
        begin[axis], end[axis] = -start, stop - dim
    return begin + end


def slice_as_pad(model: ModelProto) -> ModelProto:
    """Rewrite the int32 Slices of the main graph of ``model`` as Pads (in place; returns it)."""
    if opset(model) < 11:  # Pad's pads became an input in opset 11
        return model
    static = _static(model)
    known = constants(model.graph)
    names = Names(model.graph, "slice_as_pad")
    nodes = []
    for node in model.graph.node:
        typed = static.get(node.input[0]) if node.op_type == "Slice" and node.domain in ("", "ai.onnx") else None
        pads = _pads(node, typed[1], known) if typed is not None and typed[0] in _TYPES else None
        if pads is None:
            nodes.append(node)
            continue
        name = names("pads")
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(pads, np.int64),
                                                                                            name)))
        nodes.append(helper.make_node("Pad", [node.input[0], name], list(node.output), name=node.name, mode="constant"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model
