"""Which nodes are linear layers, the Hugging Face module each computes, and which ones a target picks.

A linear layer is a ``MatMul`` or ``Gemm`` whose weight is a constant (an initializer, maybe
through ``Transpose``, ``Cast``, ``Identity`` or ``DequantizeLinear``) or a ``MatMulNBits``
(com.microsoft, its 4/8-bit weight an initializer). Its module path comes from, in turn:

* the node's name as onnxruntime-genai's builder and the TorchScript exporter write it
  (``/model/layers.0/attn/qkv_proj/MatMul_Q4`` -> ``model.layers.0.attn.qkv_proj``);
* the name scopes torch's dynamo exporter records on the node (``pkg.torch.onnx.name_scopes``);
* the weight's name without ``.weight``;

relative to the causal LM, where ``lm_head`` is (an export of a module that holds the model
as ``m`` names them ``m.model.layers.0...``).

onnxruntime-genai's builder names attention ``attn`` where Hugging Face says ``self_attn``,
and fuses ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` (and with
``fuse_mlp_gate_up``, ``gate_proj``/``up_proj`` into ``gate_up_proj``): such a node computes
several modules, one slice of its output each, and each gets its own adapter, so that LoRA
on it is exactly peft's LoRA on the unfused model.

Targets have peft's meaning (``LoraConfig.target_modules``): a list of names, each matching
a module whose path is it or ends with ``.`` + it; or one string, a regular expression that
must match the whole path; ``"all-linear"``: every linear module but ``lm_head``. A fused
node's own name (``qkv_proj``) matches all its slices.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from ..errors import TrainingOpError

MS_DOMAIN = "com.microsoft"
WEIGHT_PATH_OPS = ("Transpose", "Cast", "Identity", "DequantizeLinear")
NAME_SCOPES = "pkg.torch.onnx.name_scopes"
GENAI_NAMES = {"attn": "self_attn"}  # onnxruntime-genai's builder's names -> Hugging Face's
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "PagedAttention")
ALL_LINEAR = "all-linear"
OUTPUT_LAYER = "lm_head"


@dataclass(frozen=True)
class Slice:
    """A module computed by a linear node: its output columns ``[start, stop)``."""

    module: str
    start: int
    stop: int


@dataclass(frozen=True)
class Linear:
    """A linear node: ``y = x @ W`` with ``W`` ``[in_features, out_features]``."""

    node: onnx.NodeProto
    in_features: int
    out_features: int
    path: str  # the node's module path (a fused one for genai's qkv_proj)
    slices: tuple[Slice, ...]

    @property
    def output(self) -> str:
        return self.node.output[0]


def linear_nodes(model: onnx.ModelProto, genai: dict | None = None) -> list[Linear]:
    """The model's linear nodes (main graph), in graph order.

    Args:
        model: the model.
        genai: the decoder section of onnxruntime-genai's ``genai_config.json`` if known (its
            head counts slice a fused ``qkv_proj`` when no attention node says them).
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    built_by_genai = genai is not None or any(n.op_type in ATTENTION_OPS and n.domain == MS_DOMAIN
                                              for n in graph.node)
    out = []
    for node in graph.node:
        shape = _weight_shape(node, inits, producers)
        if shape is None:
            continue
        k, n = shape
        path = _module_path(node, inits, producers, built_by_genai)
        if path is None:
            continue
        out.append((node, k, n, path))
    # paths relative to the causal LM (where lm_head is): an export of a module holding it adds a prefix
    heads = [path for *_, path in out if path.rpartition(".")[2] == OUTPUT_LAYER]
    prefix = heads[0][: -len(OUTPUT_LAYER)] if len(heads) == 1 else ""
    linears = []
    for node, k, n, path in out:
        path = path[len(prefix):] if path.startswith(prefix) else path
        slices = _slices(node, path, n, consumers, genai) if built_by_genai else (Slice(path, 0, n),)
        linears.append(Linear(node, k, n, path, slices))
    return linears


def _weight_shape(node: onnx.NodeProto, inits, producers) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear node, None for any other node."""
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
        attrs = {a.name: a.i for a in node.attribute}
        return (attrs["K"], attrs["N"]) if node.input[1] in inits else None
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
        return None
    weight, transposed = _constant_source(node.input[1], inits, producers)
    if weight is None or len(weight.dims) != 2:
        return None
    k, n = weight.dims[::-1] if transposed else weight.dims
    if node.op_type == "Gemm":
        attrs = {a.name: a.i for a in node.attribute}
        if attrs.get("transA", 0):
            return None
        if attrs.get("transB", 0):
            k, n = n, k
    return int(k), int(n)


def _constant_source(name: str, inits, producers) -> tuple[onnx.TensorProto | None, bool]:
    """The initializer ``name`` is computed from by weight-path ops, and whether a Transpose
    on the way swapped its axes."""
    transposed = False
    while name not in inits:
        node = producers.get(name)
        if node is None or node.op_type not in WEIGHT_PATH_OPS or not node.input:
            return None, False
        if node.op_type == "Transpose":
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            if perm and perm[0] != [1, 0]:
                return None, False
            transposed = not transposed
        name = node.input[0]
    return inits[name], transposed


def _module_path(node: onnx.NodeProto, inits, producers, genai: bool) -> str | None:
    parts = [p for p in node.name.split("/") if p]
    if len(parts) >= 2:
        path_parts = parts[:-1]
        if genai:
            path_parts = [GENAI_NAMES.get(p, p) for p in path_parts]
        return ".".join(path_parts)
    for entry in node.metadata_props:
        if entry.key == NAME_SCOPES:
            try:
                scopes = [s for s in ast.literal_eval(entry.value) if s]
            except (ValueError, SyntaxError):
                scopes = []
            if len(scopes) >= 2:
                return scopes[-2]  # the last scope is the op (``linear_3``); the one before, its module
    weight, _ = _constant_source(node.input[1], inits, producers) if len(node.input) > 1 else (None, False)
    if weight is not None and weight.name.endswith(".weight"):
        return weight.name[: -len(".weight")]
    return None


def _slices(node: onnx.NodeProto, path: str, n: int, consumers, genai: dict | None) -> tuple[Slice, ...]:
    prefix, _, last = path.rpartition(".")
    parts = FUSED.get(last)
    if parts is None:
        return (Slice(path, 0, n),)
    base = f"{prefix}." if prefix else ""
    if last == "gate_up_proj":
        if n % 2:
            raise TrainingOpError(f"node {node.name!r}: a fused gate_up_proj with an odd width {n}")
        widths = [n // 2, n // 2]
    else:
        widths = _qkv_widths(node, n, consumers, genai)
    out, start = [], 0
    for part, width in zip(parts, widths):
        out.append(Slice(base + part, start, start + width))
        start += width
    return tuple(out)


def _qkv_widths(node: onnx.NodeProto, n: int, consumers, genai: dict | None) -> list[int]:
    heads = kv_heads = None
    for user in consumers.get(node.output[0], []):
        if user.op_type in ATTENTION_OPS:
            attrs = {a.name: a.i for a in user.attribute}
            heads, kv_heads = attrs.get("num_heads"), attrs.get("kv_num_heads", attrs.get("num_heads"))
    if heads is None and genai:
        heads, kv_heads = genai.get("num_attention_heads"), genai.get("num_key_value_heads")
    if not heads or not kv_heads or n % (heads + 2 * kv_heads):
        raise TrainingOpError(f"node {node.name!r}: cannot split the fused qkv_proj output ({n} wide) into q, k "
                              f"and v: no attention node or genai_config.json gives the head counts")
    head = n // (heads + 2 * kv_heads)
    return [heads * head, kv_heads * head, kv_heads * head]


def module_matches(path: str, targets: Sequence[str] | str) -> bool:
    """peft's rule: a list matches a path equal to an entry or ending with ``.`` + it; a string
    is a regular expression over the whole path; ``"all-linear"`` matches all but lm_head."""
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return path.rpartition(".")[2] != OUTPUT_LAYER
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets)


def choose(linears: Sequence[Linear], targets: Sequence[str] | str) -> list[tuple[Linear, list[Slice]]]:
    """The linear nodes ``targets`` picks and, for each, the slices (modules) to adapt.

    Raises:
        TrainingOpError: a target (each of a list, or the pattern) that matches no linear
            module, naming the modules there are.
    """
    if not isinstance(targets, str):
        targets = list(targets)
        if not targets or not all(_is_name(t) for t in targets):
            raise TrainingOpError(f"targets must be module names or a regular expression, found {targets!r}")
    chosen, used = [], set()
    for linear in linears:
        picked = []
        for s in linear.slices:
            hits = [t for t in _entries(targets)
                    if any(module_matches(path, t if isinstance(targets, str) else [t])
                           for path in (s.module, linear.path))]
            if hits:
                picked.append(s)
                used.update(hits)
        if picked:
            chosen.append((linear, picked))
    unused = [t for t in _entries(targets) if t not in used]
    if unused:
        names = sorted({s.module.rpartition(".")[2] for lin in linears for s in lin.slices}
                       | {lin.path.rpartition(".")[2] for lin in linears if len(lin.slices) > 1})
        raise TrainingOpError(
            f"LoRA target{'s' if len(unused) > 1 else ''} {', '.join(map(repr, unused))} match"
            f"{'' if len(unused) > 1 else 'es'} no linear module (MatMul, Gemm or MatMulNBits with a constant "
            f"weight); the model's linear modules end in: {', '.join(names) or 'none'}")
    return chosen


def _entries(targets: Sequence[str] | str) -> list[str]:
    return [targets] if isinstance(targets, str) else list(targets)


def _is_name(value: object) -> bool:
    """A non-empty string (a target as given: the annotation is not enforced)."""
    return isinstance(value, str) and bool(value)
