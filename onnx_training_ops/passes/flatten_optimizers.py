"""Pass (portable form): run each multi-tensor optimizer node over its tensors laid end to end.

``Adam(R, T, X1..Xn, G1..Gn, V1..Vn, H1..Hn)`` becomes one single-tensor ``Adam`` over
``Concat(Reshape(Xi, [1, -1]), axis=1)`` (and the same for G, V, H), its new values cut back into the
tensors by ``Slice`` and ``Reshape``. Once :func:`.lower_optimizers` has lowered it, the
optimizer is one chain of ~16 elementwise ops over all parameters instead of ~16 per tensor:
on a GPU each op is a kernel launch (GPT-2 124M: 148 tensors, ~2,400 launches, against ~20
plus the copies), and each op over one long buffer runs at memory bandwidth.

Every update the spec defines is elementwise, with the same scalars (R, T, the attributes)
for every tensor of a node, so the flat chain computes each element exactly as the
per-tensor chains do: bit for bit. The cut uses one ``Slice`` per tensor, not ``Split``:
onnxruntime's CUDA ``Split`` fills and uploads a host table as long as the split axis (an
int64 per element) on every run. A node is left as it is when a tensor's shape is not static,
a G, V or H is not shaped like its X (the spec allows broadcasting), the tensors differ in
dtype, or it has one tensor (nothing to gain).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, helper, numpy_helper

from ..schema import DOMAIN, OPTIMIZERS
from ..walk import model_graphs
from ._graph import ValueType, all_names, unique_name

MIN_OPSET = 13  # Slice and Reshape with their bounds and shape as inputs


def _layout(node: onnx.NodeProto, n: int, groups: int, types: dict[str, ValueType]) -> list[tuple[int, ...]] | None:
    """The static shape of each tensor of ``node``, or None when the node cannot be flattened."""
    shapes, dtypes = [], set()
    for i in range(n):
        names = [node.input[2 + j * n + i] for j in range(groups)]
        found = [types.get(name) for name in names]
        if any(t is None or t.static_shape is None for t in found):
            return None
        if len({t.static_shape for t in found}) != 1:  # G, V or H broadcast against X
            return None
        dtypes |= {t.elem_type for t in found}
        shapes.append(found[0].static_shape)
    return shapes if len(dtypes) == 1 else None


def _flatten_node(node: onnx.NodeProto, shapes: list[tuple[int, ...]], graph: GraphProto,
                  taken: set[str]) -> list[onnx.NodeProto]:
    spec = OPTIMIZERS[node.op_type]
    n, base = len(shapes), node.name or node.output[0] or node.op_type
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]

    known: dict[tuple[int, ...], str] = {}

    def constant(values) -> str:  # int64 constants, each value once (the next start is this end)
        key = tuple(values)
        if key not in known:
            known[key] = unique_name(taken, "flat/c")
            graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), known[key]))
        return known[key]

    # [1, total], not [total]: onnx's shape inference with data propagation (which the
    # lowering runs) treats a 1-D tensor as shape data, one dim per element: 16 GB and 40 s
    # for a 16M-parameter model; a 2-D buffer is left alone
    flat_shape = constant([1, -1])
    axes = constant([1])
    nodes, flat_inputs = [], []
    for j, role in enumerate(spec.tensor_inputs):
        pieces = []
        for i in range(n):
            piece = unique_name(taken, f"{base}/flat/{role}{i}")
            nodes.append(helper.make_node("Reshape", [node.input[2 + j * n + i], flat_shape], [piece]))
            pieces.append(piece)
        flat = unique_name(taken, f"{base}/flat/{role}")
        nodes.append(helper.make_node("Concat", pieces, [flat], axis=1))
        flat_inputs.append(flat)
    flat_outputs = [unique_name(taken, f"{base}/flat/{role}") for role in spec.tensor_outputs]
    update = helper.make_node(node.op_type, [*node.input[:2], *flat_inputs], flat_outputs,
                              name=unique_name(taken, f"{base}/flat"), domain=DOMAIN, doc_string=node.doc_string)
    update.attribute.extend(node.attribute)
    nodes.append(update)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for k, flat in enumerate(flat_outputs):
        for i in range(n):
            out = node.output[k * n + i] if k * n + i < len(node.output) else ""
            if not out:
                continue
            piece = unique_name(taken, f"{out}/flat_slice")
            start, end = constant([offsets[i]]), constant([offsets[i + 1]])
            nodes.append(helper.make_node("Slice", [flat, start, end, axes], [piece]))
            nodes.append(helper.make_node("Reshape", [piece, constant(list(shapes[i]))], [out]))
    return nodes


def _flatten_graph(graph: GraphProto, types: dict[str, ValueType], taken: set[str]) -> None:
    new_nodes = []
    for node in graph.node:
        spec = OPTIMIZERS.get(node.op_type) if node.domain == DOMAIN else None
        n = spec.n_tensors(len(node.input)) if spec is not None else None
        shapes = _layout(node, n, spec.n_groups_in, types) if n and n > 1 else None
        if shapes is None:
            new_nodes.append(node)
            continue
        new_nodes.extend(_flatten_node(node, shapes, graph, taken))
    del graph.node[:]
    graph.node.extend(new_nodes)


def flatten_optimizers(model: ModelProto) -> ModelProto:
    """Flatten every multi-tensor optimizer node of the top-level graphs (the main graph and
    each training_info graph; in place; returns ``model``). Needs ai.onnx opset >= 13; a model
    importing less is left as it is."""
    from .lower_optimizers import types_by_graph

    opsets = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not opsets or opsets[0] < MIN_OPSET:
        return model
    if not any(n.domain == DOMAIN and n.op_type in OPTIMIZERS for g in model_graphs(model) for n in g.node):
        return model
    taken: set[str] = set()
    for graph in model_graphs(model):
        taken |= all_names(graph)
    for top, types, _ in types_by_graph(model):
        _flatten_graph(top, types, taken)
    return model
