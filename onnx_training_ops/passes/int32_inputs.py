"""Pass: int64 data inputs become int32 inputs, their index arithmetic int32 too.

onnxruntime-web's WebGPU execution provider runs no int64 arithmetic (1.30: int64 nodes fall
back to the CPU, or run in 32 bits when int64 is switched on). Labels (the lowered OneHot casts
them to float32; a causal LM's shifted labels pass Slice, Pad, Reshape, Equal and Where on their
way to the loss's GatherElements) and token ids (Gather indices; the embedding gradient wraps
negative ids with Less/Add/Where before a ScatterND) need no int64: the input is declared int32
and the trainer converts the batch (refusing a value outside the int32 range). From each such
input the pass follows the values computed from it: Cast, comparisons and the indices of
Gather/GatherElements/ScatterElements read int32 as they are; arithmetic (Add/Sub/Mul, and
ReduceSum: an attention mask's row lengths), Where and data movement
(Unsqueeze/Reshape/Squeeze/Flatten/Expand/Identity/Slice/Pad/Gather/Concat) compute in int32
(their int64 constant operands, if within the int32 range, get int32 copies; shapes, axes,
pads and indices stay as they are); any other reader (ScatterND's indices must be
int64) gets a Cast back to int64 in front of it. An input whose values meet a non-constant int64
operand or a constant outside int32 stays int64.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ._rewrite import Names, constants

_READ_AS_IS = {"Cast", "Less", "Greater", "Equal", "LessOrEqual", "GreaterOrEqual"}
_INDEX_INPUT = {"Gather": 1, "GatherElements": 1, "ScatterElements": 1}  # int32 or int64 indices
_ALL = None
# op -> the input slots whose values flow into the output (None: all); the other slots are
# shapes, axes, pads, indices or Where's condition, read as they are
_VALUE_SLOTS: dict[str, tuple[int, ...] | None] = {
    "Add": _ALL, "Sub": _ALL, "Mul": _ALL, "Concat": _ALL, "Where": (1, 2), "Pad": (0, 2),
    "Unsqueeze": (0,), "Reshape": (0,), "Squeeze": (0,), "Flatten": (0,), "Expand": (0,), "Identity": (0,),
    "Slice": (0,), "Gather": (0,), "ReduceSum": (0,)}


def _in_int32(value: np.ndarray) -> bool:
    return not value.size or (value.min() >= -2 ** 31 and value.max() < 2 ** 31)


def _int32_constant(name: str, known: dict) -> bool:
    """Whether ``name`` is an int64 constant whose values fit int32 (it can be copied as int32)."""
    return name in known and known[name].dtype == np.int64 and _in_int32(known[name])


def _plan(graph, start: str, known: dict, readers: dict) -> tuple[set[str], list, list] | None:
    """Values that become int32, constants to copy as int32 (node, input index), readers that
    need a Cast back (node, input index); None when the input must stay int64."""
    narrow, copies, casts = {start}, [], []
    work = [start]
    outputs = {o.name for o in graph.output}
    while work:
        value = work.pop()
        if value in outputs:
            return None
        for node in readers.get(value, []):
            slots = [k for k, name in enumerate(node.input) if name == value]
            if node.op_type in _READ_AS_IS:
                if node.op_type != "Cast":
                    other_inputs = [k for k, other in enumerate(node.input) if other not in narrow and k not in slots]
                    if not all(_int32_constant(node.input[k], known) for k in other_inputs):
                        return None
                    copies += [(node, k) for k in other_inputs]
                continue
            if node.op_type in _INDEX_INPUT and slots == [_INDEX_INPUT[node.op_type]]:
                continue
            if node.op_type in _VALUE_SLOTS:
                values = _VALUE_SLOTS[node.op_type]
                values = range(len(node.input)) if values is None else values
                index = _INDEX_INPUT.get(node.op_type)
                if any(k not in values and k != index for k in slots):
                    return None  # read as a shape, axes or pads
                for k in values:
                    other = node.input[k] if k < len(node.input) else ""
                    if k in slots or not other or other in narrow:
                        continue
                    if not _int32_constant(other, known):
                        return None
                    copies.append((node, k))
                if node.output[0] not in narrow:
                    narrow.add(node.output[0])
                    work.append(node.output[0])
                continue
            casts.extend((node, k) for k in slots)
    return narrow, copies, casts


def int32_inputs(model: ModelProto, skip: Iterable[str] = ()) -> list[str]:
    """Retype the int64 data inputs of ``model`` to int32 where the module docstring allows (in place).

    Args:
        model: the model to rewrite.
        skip: inputs left as they are (the state).

    Returns:
        The names of the inputs now int32.
    """
    graph = model.graph
    skip = set(skip)
    known = constants(graph)
    changed = []
    for vi in graph.input:
        if vi.name in skip or vi.type.tensor_type.elem_type != TensorProto.INT64:
            continue
        readers: dict = {}
        for n in graph.node:
            for i in n.input:
                readers.setdefault(i, []).append(n)
        plan = _plan(graph, vi.name, known, readers)
        if plan is None or not readers.get(vi.name):
            continue
        narrow, copies, casts = plan
        names = Names(graph, f"int32/{vi.name}")
        added = []
        for node, k in copies:
            name = names("constant")
            added.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
                known[node.input[k]].astype(np.int32), name)))
            node.input[k] = name
        for node, k in casts:
            name = names("int64")
            added.append(helper.make_node("Cast", [node.input[k]], [name], to=TensorProto.INT64))
            node.input[k] = name
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend(added[:len(copies)])  # constants first
        for node in nodes:  # each Cast back right before its reader
            for cast in added[len(copies):]:
                if cast.output[0] in node.input:
                    graph.node.append(cast)
            graph.node.append(node)
        narrowed_values = narrow - {vi.name}
        for info in graph.value_info:
            if info.name in narrowed_values:
                info.type.tensor_type.elem_type = TensorProto.INT32
        vi.type.tensor_type.elem_type = TensorProto.INT32
        changed.append(vi.name)
    return changed
