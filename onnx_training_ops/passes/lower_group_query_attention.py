"""Pass: float32 ``GroupQueryAttention`` (its prompt form) -> standard ops, for a CUDA device.

onnxruntime's CUDA GroupQueryAttention takes float16 and bfloat16 only (``docs/OperatorKernels.md``):
the float32 node of an onnxruntime-genai model built for the CPU (``-e cpu``, the int4 and fp32
builds) runs on the CPU in a CUDA session, with copies to and from the device around it every
step, and onnxruntime refuses CUDA graphs for the step. This pass writes such a node with
standard ops the CUDA EP has float32 kernels for, before the Gradient is expanded (its gradient
then comes from theirs), by the math of the node's derivative rule
(:func:`~onnx_training_ops.autodiff.rules_attention.group_query`: packed or separate Q/K/V,
rotary from ``cos_cache``/``sin_cache`` at positions ``0..S-1``, grouped heads, causal, local
window, softcap, keys past ``seqlens_k`` left out)::

    s = alpha Q Kᵀ  [c tanh(s / c)]   P = softmax(s, keys not attended left out)   O = P V

``present_key``/``present_value``, when something reads them, are the past (empty in the
prompt form) followed by the rotated keys and the values, ``[B, kv_heads, S, head_size]``. As the
rule, the graph checks at run time that the node runs its prompt form (``sequence_length ==
total_sequence_length``): a run with a past fails in a node that says so. Nodes of other
element types, and forms the rule does not cover (``position_ids``, an attention bias, a
quantized KV cache...), are left as they are.
"""

from __future__ import annotations

from onnx import ModelProto, NodeProto, TensorProto, helper

from ..autodiff.emitter import Emitter, ValueMeta
from ..autodiff.registry import RuleError
from ..autodiff.rules_attention import GQA_UNCOVERED, group_query
from ._graph import rename_values, value_types

MS = "com.microsoft"


def lower_group_query_attention(model: ModelProto) -> ModelProto:
    graph = model.graph
    nodes = [n for n in graph.node if n.domain == MS and n.op_type == "GroupQueryAttention"]
    if not nodes:
        return model
    types = value_types(model)
    meta = {name: ValueMeta(t.elem_type or None, t.shape) for name, t in types.items()}
    read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    replaced: dict[int, list[NodeProto]] = {}
    for index, node in enumerate(nodes):
        lowered = _lowered(node, meta, read, opset, index)
        if lowered is not None:
            replaced[id(node)] = lowered
    if replaced:
        kept = [new for node in graph.node for new in replaced.get(id(node), [node])]
        del graph.node[:]
        graph.node.extend(kept)
    return model


def covered(node: NodeProto, meta: dict[str, ValueMeta], read: set[str]) -> bool:
    """Whether ``node`` is a float32 GroupQueryAttention in a form the lowering covers."""
    query = meta.get(node.input[0])
    if query is None or query.dtype != TensorProto.FLOAT:
        return False
    if (len(node.input) > 3 and bool(node.input[3])) != (len(node.input) > 4 and bool(node.input[4])):
        return False  # one past without the other: onnxruntime's own message
    inputs, attrs = GQA_UNCOVERED
    if any(i < len(node.input) and node.input[i] for i in inputs):
        return False
    if any(a.name in attrs and helper.get_attribute_value(a) not in (0, -1, b"NONE", "NONE") for a in node.attribute):
        return False
    return not (len(node.output) > 3 and node.output[3] and node.output[3] in read)


def _lowered(node: NodeProto, meta: dict[str, ValueMeta], read: set[str], opset: int, index: int
             ) -> list[NodeProto] | None:
    if opset < 13 or not covered(node, meta, read):
        return None
    em = Emitter(f"{node.name or node.output[0]}/standard_{index}/", opset, meta)
    try:
        gq = group_query(em, node, "(in standard ops)")
        outputs = {node.output[0]: gq.output(em, node.input[0])}
    except (RuleError, LookupError):  # a shape it needs is unknown: the node stays
        return None
    for i, new in ((1, gq.k4), (2, gq.v4)):  # the KV cache: past then the new keys / values, BNSH
        if i < len(node.output) and node.output[i] and node.output[i] in read:
            heads = em.op("Transpose", [new], "present", perm=[0, 2, 1, 3])
            past = node.input[i + 2] if len(node.input) > i + 2 else ""
            outputs[node.output[i]] = em.op("Concat", [past, heads], "present", axis=2) if past else heads
    return _renamed(em.nodes, outputs)


def _renamed(nodes: list[NodeProto], outputs: dict[str, str]) -> list[NodeProto]:
    """``nodes`` with each emitted value of ``outputs`` (wanted name -> emitted name) written under
    its wanted name."""
    rename_values(nodes, {emitted: wanted for wanted, emitted in outputs.items()})
    return nodes


__all__ = ["covered", "lower_group_query_attention"]
