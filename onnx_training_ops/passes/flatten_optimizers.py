"""Pass (portable form): run each multi-tensor optimizer node over its tensors laid end to end.

``Adam(R, T, X1..Xn, G1..Gn, V1..Vn, H1..Hn)`` becomes a few single-tensor ``Adam`` nodes, one
per group of at most :data:`GROUP` tensors, each over the group's tensors laid end to end (the
same for G, V, H), their new values cut back into the tensors by ``Slice`` and ``Reshape``.
Once :func:`.lower_optimizers` has lowered them, the optimizer is a few chains of ~16
elementwise ops over all parameters instead of ~16 per tensor: on a GPU each op is a kernel
launch (GPT-2 124M: 148 tensors, ~2,400 launches, against ~80 plus the copies), and each op
over a long buffer runs at memory bandwidth.

The buffers are laid out for onnxruntime's CUDA ``Concat``: a Concat of pieces of different
sizes fills and uploads, on every run, a host table with one int64 per element of the concat
axis (``concat.cc``; onnxruntime PR #32119 passes it by value for at most 32 pieces). So each
group is one Concat of at most 32 pieces along axis 0 of a ``[rows, width]`` buffer, each piece
reshaped to ``[size / width, width]``: the table has one entry per row, not per element
(GPT-2 124M: 162K rows of 768, not 124M entries, in each of the four Concats). The width is
chosen per group (:func:`_width`): a common divisor of the sizes, or a wider one with the few
odd pieces (a classifier's bias) zero-padded, whichever uploads less (a Pad is a kernel launch
per piece); the padding is computed and cut away, never read back.

Every update the spec defines is elementwise, with the same scalars (R, T, the attributes)
for every tensor of a node, so the flat chains compute each element exactly as the
per-tensor chains do: bit for bit. The cut uses one ``Slice`` per tensor, not ``Split``
(the CUDA ``Split`` of unequal pieces fills and uploads the same table, one int64 per element
of the buffer), each over two axes: onnxruntime's ``GatherSliceToSplitFusion`` merges
single-axis Slices that cover a tensor into such a Split (GPT-2 124M: three Splits with
124M-entry tables per step before, besides the four Concats). A node is left as it is (and :func:`flatten_optimizers`
says why in a warning) when an X's shape is not static, a G, V or H is statically
shaped unlike its X (the spec allows broadcasting), the tensors differ in dtype, or it has one
tensor (nothing to gain). A G whose shape inference does not know (a gradient of a graph with
symbolic dims) is reshaped to its X's exact size: a G of another size fails at run time, never
silently.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, TensorProto, helper, numpy_helper

from ..schema import DOMAIN, OPTIMIZERS
from ..walk import model_graphs
from ._graph import ValueType, all_names, unique_name

MIN_OPSET = 13  # Slice and Reshape with their bounds and shape as inputs
GROUP = 32
"""The most tensors one flat buffer holds: onnxruntime's CUDA Concat of at most 32 pieces
passes their addresses (and, with PR #32119, their sizes) by value."""
PAD_COST_ROWS = 5000
"""A padded piece costs a Pad launch per buffer (~5 µs): about what uploading 5,000 more rows
of the Concat's host table costs."""
_PADDABLE = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16}  # the CUDA Pad's float types


def _layout(node: onnx.NodeProto, n: int, groups: int, types: dict[str, ValueType]
            ) -> tuple[list[tuple[int, ...]], int] | str:
    """The static shape of each X of ``node`` and their dtype, or why the node cannot be flattened."""
    shapes, dtypes = [], set()
    for i in range(n):
        names = [node.input[2 + j * n + i] for j in range(groups)]
        x = types.get(names[0])
        if x is None or x.static_shape is None:
            return f"the shape of {names[0]!r} is not static"
        for name in names[1:]:
            other = types.get(name)
            if other is not None and other.static_shape is not None and other.static_shape != x.static_shape:
                return (f"{name!r} of shape {list(other.static_shape)} broadcasts against {names[0]!r} of "
                        f"shape {list(x.static_shape)}")
            if other is not None and other.elem_type:
                dtypes.add(other.elem_type)
        dtypes.add(x.elem_type)
        shapes.append(x.static_shape)
    if len(dtypes) != 1:
        return f"its tensors differ in dtype ({', '.join(sorted(TensorProto.DataType.Name(t) for t in dtypes))})"
    return shapes, dtypes.pop()


def _width(sizes: list[int], paddable: bool) -> int:
    """The row width of a group's buffer: the fewest host-table rows, a padded piece counted
    as :data:`PAD_COST_ROWS` rows, padding at most 1/64 of the group."""
    everything = math.gcd(*sizes)
    if not paddable:
        return everything
    total = sum(sizes)
    candidates = {everything, *(1 << k for k in range(17)), *sizes}
    for s in sizes:  # widths that fit the pieces at least this big (the smaller ones padded)
        candidates.add(math.gcd(*(t for t in sizes if t >= s)))

    def cost(width: int) -> tuple[float, int]:
        rows = sum(-(-s // width) for s in sizes)
        padding = rows * width - total
        padded = sum(s % width != 0 for s in sizes)
        if padding * 64 > total:
            return math.inf, 0
        return rows + PAD_COST_ROWS * padded, -width

    return min(candidates, key=cost)


def _chunks(count: int) -> list[range]:
    """``range(count)`` cut into the fewest runs of at most :data:`GROUP`, of even lengths."""
    parts = -(-count // GROUP)
    bounds = [round(k * count / parts) for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _flatten_node(node: onnx.NodeProto, shapes: list[tuple[int, ...]], dtype: int, graph: GraphProto,
                  taken: set[str]) -> list[onnx.NodeProto]:
    spec = OPTIMIZERS[node.op_type]
    n, base = len(shapes), node.name or node.output[0] or node.op_type
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    known: dict[tuple[int, ...], str] = {}

    def constant(values) -> str:  # int64 constants, each value once
        key = tuple(values)
        if key not in known:
            known[key] = unique_name(taken, "flat/c")
            graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), known[key]))
        return known[key]

    def named(hint: str) -> str:
        return unique_name(taken, hint)

    axes = constant([0, 1])
    nodes: list[onnx.NodeProto] = []
    for g, members in enumerate(_chunks(n)):
        tag = f"{base}/flat{g}" if len(_chunks(n)) > 1 else f"{base}/flat"
        width = _width([sizes[i] for i in members], dtype in _PADDABLE)
        rows = {i: -(-sizes[i] // width) for i in members}
        flat_inputs = []
        for j, role in enumerate(spec.tensor_inputs):
            pieces = []
            for i in members:
                source = node.input[2 + j * n + i]
                if sizes[i] % width:  # [1, size] padded with zeros to [1, rows * width]
                    line = named(f"{tag}/{role}{i}/line")
                    padded = named(f"{tag}/{role}{i}/padded")
                    nodes.append(helper.make_node("Reshape", [source, constant([1, sizes[i]])], [line]))
                    nodes.append(helper.make_node("Pad", [line, constant([0, 0, 0, rows[i] * width - sizes[i]])],
                                                  [padded]))
                    source = padded
                piece = named(f"{tag}/{role}{i}")
                # the exact [rows, width]: a G of another size fails here at run time, never silently
                nodes.append(helper.make_node("Reshape", [source, constant([rows[i], width])], [piece]))
                pieces.append(piece)
            flat = named(f"{tag}/{role}")
            nodes.append(helper.make_node("Concat", pieces, [flat], axis=0) if len(pieces) > 1
                         else helper.make_node("Identity", pieces, [flat]))
            flat_inputs.append(flat)
        flat_outputs = [named(f"{tag}/{role}") for role in spec.tensor_outputs]
        update = helper.make_node(node.op_type, [*node.input[:2], *flat_inputs], flat_outputs,
                                  name=named(tag), domain=DOMAIN, doc_string=node.doc_string)
        update.attribute.extend(node.attribute)
        nodes.append(update)
        total = sum(rows.values()) * width
        offset = 0
        offsets = {}
        for i in members:
            offsets[i] = offset
            offset += rows[i] * width
        for k, flat in enumerate(flat_outputs):
            line = named(f"{flat}/line")
            nodes.append(helper.make_node("Reshape", [flat, constant([1, total])], [line]))
            for i in members:
                out = node.output[k * n + i] if k * n + i < len(node.output) else ""
                if not out:
                    continue
                piece = named(f"{out}/flat_slice")
                # row 0 and the piece's columns: two axes, so that onnxruntime's
                # GatherSliceToSplitFusion does not merge the slices into one ragged Split
                start, end = constant([0, offsets[i]]), constant([1, offsets[i] + sizes[i]])
                nodes.append(helper.make_node("Slice", [line, start, end, axes], [piece]))
                nodes.append(helper.make_node("Reshape", [piece, constant(list(shapes[i]))], [out]))
    return nodes


def _flatten_graph(graph: GraphProto, types: dict[str, ValueType], taken: set[str]) -> list[str]:
    new_nodes, refused = [], []
    for node in graph.node:
        spec = OPTIMIZERS.get(node.op_type) if node.domain == DOMAIN else None
        n = spec.n_tensors(len(node.input)) if spec is not None else None
        if spec is None or n is None:
            new_nodes.append(node)
            continue
        found = _layout(node, n, spec.n_groups_in, types) if n > 1 else "it updates one tensor"
        if isinstance(found, str):
            if n > 1:
                refused.append(f"{node.op_type} node {node.name or node.output[0]!r} ({n} tensors): {found}")
            new_nodes.append(node)
            continue
        new_nodes.extend(_flatten_node(node, *found, graph, taken))
    del graph.node[:]
    graph.node.extend(new_nodes)
    return refused


def flatten_optimizers(model: ModelProto) -> ModelProto:
    """Flatten every multi-tensor optimizer node of the top-level graphs (the main graph and
    each training_info graph; in place; returns ``model``). Needs ai.onnx opset >= 13; a model
    importing less is left as it is. A node of several tensors left per tensor is named, with
    why, in a warning: the flat form was asked for (``flat_optimizer=True``, a device session)."""
    from .lower_optimizers import types_by_graph

    opsets = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not any(n.domain == DOMAIN and n.op_type in OPTIMIZERS for g in model_graphs(model) for n in g.node):
        return model
    if not opsets or opsets[0] < MIN_OPSET:
        warnings.warn(f"the optimizer stays one update per tensor: the flat form needs ai.onnx opset >= {MIN_OPSET}, "
                      f"the model imports {opsets[0] if opsets else 'none'}", stacklevel=2)
        return model
    taken: set[str] = set()
    for graph in model_graphs(model):
        taken |= all_names(graph)
    refused = []
    for top, types, _ in types_by_graph(model):
        refused += _flatten_graph(top, types, taken)
    if refused:
        warnings.warn("the optimizer stays one update per tensor for " + "; ".join(refused), stacklevel=2)
    return model
