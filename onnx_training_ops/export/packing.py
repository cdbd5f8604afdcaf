"""The packed step (``export_step(..., packed=True)``): the state as one input per dtype.

onnxruntime's JavaScript binding converts every input and copies every output on each run:
a step model with one input and one output per state variable (a small BERT has about 300 of
each) pays that cost hundreds of times a step. ``step.packed.onnx`` is the same step with the
state variables of each dtype laid end to end in one flat input (a ``Slice`` then a ``Reshape``
per variable, the graph unchanged) and their new values in one flat output
(``Reshape`` to 1-D, ``Concat``). The manifest's ``packs`` give each variable's offset and
shape, so a client can still read and write the state by name (``state.safetensors`` keeps
one tensor per variable). Bit for bit the same step: Slice, Reshape and Concat move bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..walk import all_graphs


def _default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _cut(pack: str, pieces: list[str], sizes: list[int], graph: onnx.GraphProto, as_input: bool
         ) -> list[onnx.NodeProto]:
    """One ``Slice`` per piece of the flat ``pack``. Not ``Split``: onnxruntime's CUDA Split
    builds a host table with one int64 per element of the split axis and uploads it on every
    run (``core/providers/cuda/tensor/split.cc``): 3 GB a step for GPT-2 124M's 372M-float
    pack, the likely cause of the packed step's 5.3 s on the CUDA EP."""
    nodes, offset = [], 0
    for i, (piece, size) in enumerate(zip(pieces, sizes)):
        if as_input:
            bounds = [f"{pack}/starts{i}", f"{pack}/ends{i}"]
            graph.initializer.append(numpy_helper.from_array(np.array([offset], np.int64), bounds[0]))
            graph.initializer.append(numpy_helper.from_array(np.array([offset + size], np.int64), bounds[1]))
            nodes.append(helper.make_node("Slice", [pack, *bounds], [piece]))
        else:  # opset < 10: bounds as attributes
            nodes.append(helper.make_node("Slice", [pack], [piece], starts=[offset], ends=[offset + size], axes=[0]))
        offset += size
    return nodes


def packed_step(step: onnx.ModelProto, state: Mapping[str, np.ndarray],
                feedback: Mapping[str, str]) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """``step`` with the fed-back state packed per dtype; the manifest's ``packs``."""
    packed = onnx.ModelProto()
    packed.CopyFrom(step)
    graph = packed.graph
    graph.name = f"{graph.name}_packed"
    taken = {n for g in all_graphs(graph) for node in g.node for n in (*node.input, *node.output)}
    taken |= {vi.name for vi in (*graph.input, *graph.output)} | {t.name for t in graph.initializer}
    order = [vi.name for vi in graph.input if vi.name in feedback]
    groups: dict[np.dtype, list[str]] = {}
    for name in order:
        groups.setdefault(state[name].dtype, []).append(name)
    slice_as_input = _default_opset(packed) >= 10
    unpack, repack, inputs, outputs, packs = [], [], [], [], []
    for dtype, names in groups.items():
        elem = helper.np_dtype_to_tensor_dtype(dtype)
        pack_in, pack_out = f"state.{dtype.name}", f"state.{dtype.name}.new"
        for name in (pack_in, pack_out):
            if name in taken:
                raise ValueError(f"the step model already has a value named {name!r}")
        sizes = [int(state[n].size) for n in names]
        pieces = [f"{pack_in}/{i}" for i in range(len(names))] if len(names) > 1 else [pack_in]
        if len(names) > 1:
            unpack += _cut(pack_in, pieces, sizes, graph, slice_as_input)
        flat_outputs, members, offset = [], [], 0
        for i, (name, piece, size) in enumerate(zip(names, pieces, sizes)):
            shape = f"{pack_in}/shape{i}"
            graph.initializer.append(numpy_helper.from_array(np.array(state[name].shape, np.int64), shape))
            unpack.append(helper.make_node("Reshape", [piece, shape], [name]))
            flat = f"{pack_out}/{i}"
            repack.append(helper.make_node("Reshape", [feedback[name], f"{pack_in}/flat"], [flat]))
            flat_outputs.append(flat)
            members.append({"name": name, "offset": offset, "shape": list(state[name].shape)})
            offset += size
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), f"{pack_in}/flat"))
        repack.append(helper.make_node("Concat", flat_outputs, [pack_out], axis=0) if len(names) > 1
                      else helper.make_node("Identity", flat_outputs, [pack_out]))
        inputs.append(helper.make_tensor_value_info(pack_in, elem, [offset]))
        outputs.append(helper.make_tensor_value_info(pack_out, elem, [offset]))
        packs.append({"dtype": dtype.name, "input": pack_in, "output": pack_out, "size": offset,
                      "members": members})
    fed_back = set(feedback.values())
    kept_inputs = [vi for vi in graph.input if vi.name not in feedback]
    kept_outputs = [vo for vo in graph.output if vo.name not in fed_back]
    nodes = [*unpack, *graph.node, *repack]
    del graph.input[:], graph.output[:], graph.node[:]
    graph.input.extend([*kept_inputs, *inputs])
    graph.output.extend([*kept_outputs, *outputs])
    graph.node.extend(nodes)
    onnx.checker.check_model(packed, full_check=True)
    return packed, packs
