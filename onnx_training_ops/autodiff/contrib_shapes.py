"""Types and shapes of onnxruntime's contrib ops, which onnx's shape inference does not know.

onnx stops at a ``com.microsoft`` node: its outputs, and everything computed from them, stay
untyped unless the model carries ``value_info`` for them (onnxruntime-genai's builder writes
it for its intermediates, not for the graph outputs a loss reads, nor for nodes added later).
:func:`complete` walks the graph once in order and fills in what is missing: the contrib ops'
outputs from the table below, the standard ops' from onnx's per-node inference, so the rules
downstream see ranks and static sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence

import onnx
from onnx import TensorProto, helper

from .emitter import ValueMeta
from .registry import rule_key

Meta = MutableMapping[str, ValueMeta]


def _dims(meta: Meta, name: str) -> tuple | None:
    return meta[name].shape if name in meta else None


def _like(node, meta: Meta) -> list[ValueMeta | None]:
    """Every output shaped and typed like input 0."""
    return [meta.get(node.input[0])] * len(node.output)


def _matmul_nbits(node, meta: Meta) -> list[ValueMeta | None]:
    a = meta.get(node.input[0])
    n = next(helper.get_attribute_value(at) for at in node.attribute if at.name == "N")
    return [None if a is None else ValueMeta(a.dtype, None if a.shape is None else (*a.shape[:-1], n))]


def _skip_norm(node, meta: Meta) -> list[ValueMeta | None]:
    """output, mean, inv_std_var ([..., 1], float), input + skip (+ bias)."""
    x = meta.get(node.input[0])
    if x is None:
        return [None] * len(node.output)
    stats = ValueMeta(TensorProto.FLOAT, None if x.shape is None else (*x.shape[:-1], 1))
    out: list[ValueMeta | None] = [x, stats, stats, x]
    return out[:len(node.output)]


def _simplified_norm(node, meta: Meta) -> list[ValueMeta | None]:
    x = meta.get(node.input[0])
    if x is None:
        return [None] * len(node.output)
    out: list[ValueMeta | None] = [x, ValueMeta(TensorProto.FLOAT, None)]
    return out[:len(node.output)]


def _attention(node, meta: Meta) -> list[ValueMeta | None]:
    """``[B, S, heads * head_size]`` (GQA, packed or not) or ``[B, S, hidden of V]`` (MHA)."""
    q = meta.get(node.input[0])
    if q is None or q.shape is None or len(q.shape) != 3:
        return [None] * len(node.output)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    width = q.shape[2]
    has_kv = len(node.input) > 2 and node.input[1] and node.input[2]
    if node.op_type == "GroupQueryAttention" and not has_kv and isinstance(width, int):
        heads, kv = attrs["num_heads"], attrs["kv_num_heads"]
        width = width // (heads + 2 * kv) * heads
    elif node.op_type == "MultiHeadAttention" and has_kv:
        v = meta.get(node.input[2])
        width = v.shape[-1] if v is not None and v.shape is not None else None
    return [ValueMeta(q.dtype, (q.shape[0], q.shape[1], width))] + [None] * (len(node.output) - 1)


def _gather_block_quantized(node, meta: Meta) -> list[ValueMeta | None]:
    data, idx, scales = (meta.get(n) for n in node.input[:3])
    if data is None or idx is None or scales is None or data.shape is None or idx.shape is None:
        return [None]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("gather_axis", 0) != 0:
        return [None]
    last = data.shape[-1]
    per_byte = 8 // attrs.get("bits", 4) if data.dtype == TensorProto.UINT8 else 1
    last = last * per_byte if isinstance(last, int) else None
    return [ValueMeta(scales.dtype, (*idx.shape, *data.shape[1:-1], last))]


SHAPES: dict[str, Callable[[onnx.NodeProto, Meta], list[ValueMeta | None]]] = {
    "com.microsoft::MatMulNBits": _matmul_nbits,
    "com.microsoft::GroupQueryAttention": _attention,
    "com.microsoft::MultiHeadAttention": _attention,
    "com.microsoft::SkipSimplifiedLayerNormalization": _skip_norm,
    "com.microsoft::SkipLayerNormalization": _skip_norm,
    "SimplifiedLayerNormalization": _simplified_norm,
    "com.microsoft::SimplifiedLayerNormalization": _simplified_norm,
    "com.microsoft::RotaryEmbedding": _like,
    "com.microsoft::GatherBlockQuantized": _gather_block_quantized,
    "com.microsoft::QuickGelu": _like,
    "com.microsoft::FastGelu": _like,
    "com.microsoft::BiasGelu": _like,
    "com.microsoft::Gelu": _like,
}


def _type_proto(m: ValueMeta) -> onnx.TypeProto:
    if m.dtype is None:
        raise LookupError("element type unknown")
    return helper.make_tensor_type_proto(m.dtype, None if m.shape is None else list(m.shape))


def _onnx_node(node: onnx.NodeProto, meta: Meta, constants: Mapping[str, onnx.TensorProto],
               opset_imports: Sequence[onnx.OperatorSetIdProto]) -> list[ValueMeta | None]:
    """onnx's inference of one standard node from its inputs' facts (constants as data)."""
    opset = next((o.version for o in opset_imports if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        return [None] * len(node.output)
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
        types = {i: _type_proto(meta[i]) for i in node.input if i}
        data = {i: constants[i] for i in node.input if i in constants}
        out = onnx.shape_inference.infer_node_outputs(schema, node, types, data, opset_imports=list(opset_imports))
    except Exception:  # an aid, not a requirement
        return [None] * len(node.output)
    return [ValueMeta.from_type(out[o]) if o in out else None for o in node.output]


def complete(nodes: Sequence[onnx.NodeProto], meta: Meta, constants: Mapping[str, onnx.TensorProto],
             opset_imports: Sequence[onnx.OperatorSetIdProto]) -> None:
    """Fill ``meta`` (in place) for the outputs it lacks: contrib ops by :data:`SHAPES`, standard
    ops whose inputs became known by onnx's per-node inference; ``nodes`` in graph order."""
    def known(name: str) -> bool:
        return name in meta and meta[name].dtype is not None

    if all(known(o) for n in nodes for o in n.output if o):
        return
    for node in nodes:
        outs = [o for o in node.output if o]
        if all(known(o) for o in outs) or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                              for a in node.attribute):
            continue
        key = rule_key(node)
        if key in SHAPES:
            facts = SHAPES[key](node, meta)
        elif node.domain in ("", "ai.onnx") and all(known(i) for i in node.input if i):
            facts = _onnx_node(node, meta, constants, opset_imports)
        else:
            continue
        for name, fact in zip(node.output, facts):
            if name and fact is not None and fact.dtype and not known(name):
                meta[name] = fact
