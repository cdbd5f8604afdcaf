"""Pass: a ``MatMulNBits`` whose float weight is wide becomes row chunks joined by a ``Concat``.

onnxruntime's CPU ``MatMulNBits`` dequantizes its whole weight to a float32 ``[N, K]`` buffer on
every call when ``B`` is not a constant it could prepack (a large model's weights are bound as
inputs, read in place from the file), and the derivative rule
(:mod:`onnx_training_ops.autodiff.rules_quantized`) dequantizes it in the backward pass: for an
LLM's ``lm_head`` (32000 x 2048) that is 262 MB at once, twice a step, beside every activation
the backward keeps. Split by output rows into nodes of at most :data:`MAX_DEQUANTIZED_BYTES`
each (``B``, scales, zero points and bias sliced by rows; ``g_idx`` shared), the same outputs
come out of a ``Concat`` on the last axis, and each chunk's weight exists in float alone: the
forward's buffer one chunk at a time, and in the backward pass each chunk's ``dY_c ·
dequant(B_c)`` made and summed in turn (onnxruntime runs a partial product's nodes when the
sum needs it).

Every output element is computed as before (a row of ``Y`` is ``A`` against one row of the
weight; with ``accuracy_level=4`` ``A`` is quantized per block of K whatever the chunk). The
chunks of a detached tensor are views of its array (no copy; memory-mapped stays mapped).
Works on the :class:`~onnx_training_ops.storage.LargeModel` (``prepare`` runs it before the
ModelProto passes), in place. A node whose quantized inputs are not initializers, or are read
by another node too, is left as it is.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..storage.large_model import LargeModel
from ..storage.tensors import all_tensors, location

MS = "com.microsoft"
MAX_DEQUANTIZED_BYTES = 32 << 20  # float32 bytes of one chunk's dequantized weight
_ROW_INPUTS = (1, 2, 3, 5)  # B, scales, zero_points, bias: one slice of rows each (g_idx: per K)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _chunks(n: int, k: int, limit: int) -> list[tuple[int, int]]:
    count = -(-n * k * 4 // limit)
    rows = -(-n // count)
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def split_wide_matmul_nbits(model: LargeModel, limit: int | None = None) -> int:
    """Split (in place) every main-graph ``MatMulNBits`` whose float32 weight exceeds ``limit``
    bytes (default :data:`MAX_DEQUANTIZED_BYTES`); returns how many were split."""
    limit = MAX_DEQUANTIZED_BYTES if limit is None else limit
    graph = model.model_proto.graph
    inits = {t.name: t for t in graph.initializer}
    reads: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    replaced: dict[int, tuple[onnx.NodeProto, list[onnx.NodeProto]]] = {}
    for index, node in enumerate(graph.node):
        if node.op_type != "MatMulNBits" or node.domain != MS:
            continue
        attrs = _attrs(node)
        n, k = int(attrs["N"]), int(attrs["K"])
        if n * k * 4 <= limit or n < 2 or attrs.get("weight_prepacked", 0):
            continue
        row_inputs = [node.input[i] for i in _ROW_INPUTS if i < len(node.input) and node.input[i]]
        if any(name not in inits or reads.get(name) != 1 or name in outputs for name in row_inputs):
            continue
        replaced[index] = (node, _split(model, node, n, _chunks(n, k, limit), inits))
    if not replaced:
        return 0
    new = [part for index, node in enumerate(graph.node)
           for part in (replaced[index][1] if index in replaced else [node])]
    del graph.node[:]
    graph.node.extend(new)
    doomed = {node.input[i] for node, _ in replaced.values() for i in _ROW_INPUTS if i < len(node.input)}
    in_message = any(t.name in doomed and location(t) is None for t in graph.initializer)
    for i in reversed([i for i, t in enumerate(graph.initializer) if t.name in doomed]):
        del graph.initializer[i]
    if in_message:  # protobuf frees a removed tensor's bytes only with the whole message
        fresh = onnx.ModelProto()
        fresh.CopyFrom(model.model_proto)
        model.model_proto = fresh
    used = {location(t) for t in all_tensors(model.model_proto)}
    model.large_initializers = {key: v for key, v in model.large_initializers.items() if key in used}
    return len(replaced)


def _split(model: LargeModel, node: onnx.NodeProto, n: int, chunks: list[tuple[int, int]],
           inits: dict[str, onnx.TensorProto]) -> list[onnx.NodeProto]:
    """The chunk nodes of ``node`` and their Concat; the chunks' tensors added to ``model``."""
    graph = model.model_proto.graph
    arrays = {i: model.array(inits[node.input[i]]) for i in _ROW_INPUTS if i < len(node.input) and node.input[i]}
    label = node.name or node.output[0]
    nodes, outs = [], []
    for start, stop in chunks:
        inputs = list(node.input)
        for i, array in arrays.items():
            source = inits[node.input[i]]
            rows = array.reshape(n, -1)[start:stop]
            part = rows.reshape((stop - start, *array.shape[1:]) if array.shape[0] == n else (-1,))
            tensor = onnx.TensorProto(name=f"{source.name}/rows{start}-{stop}", data_type=source.data_type,
                                      dims=part.shape)
            model.set_value(tensor, part, copy=False)
            graph.initializer.append(tensor)
            inputs[i] = tensor.name
        out = f"{node.output[0]}/rows{start}-{stop}"
        part_node = helper.make_node("MatMulNBits", inputs, [out], name=f"{label}/rows{start}-{stop}", domain=MS)
        part_node.attribute.extend(a for a in node.attribute if a.name != "N")
        part_node.attribute.append(helper.make_attribute("N", stop - start))
        nodes.append(part_node)
        outs.append(out)
    nodes.append(helper.make_node("Concat", outs, [node.output[0]], name=f"{label}/rows", axis=-1))
    return nodes


__all__ = ["MAX_DEQUANTIZED_BYTES", "split_wide_matmul_nbits"]
