"""Attention and rotary embeddings: onnxruntime's GroupQueryAttention, MultiHeadAttention and
RotaryEmbedding (``com.microsoft``), and ONNX's RotaryEmbedding (opset 23).

The forward node stays (its fused kernel, its numerics); the backward recomputes the
attention probabilities from the node's inputs with standard ops and differentiates them:

    s = alpha Q Kᵀ (+ bias)  [c tanh(s / c) with softcap c]  P = softmax(s masked)  O = P V
    dV = Pᵀ dO   dP = dO Vᵀ   dS = P (dP - rowsum(dP P))   dQ = alpha dS K   dK = alpha dSᵀ Q

in ``[batch, kv_heads, group, rows, head_size]`` layout, so that grouped heads (GQA) broadcast
their keys and values over the group and sum their gradients back. Rotary embeddings are
rotations by position: their adjoint is the rotation by the opposite angle (``sin -> -sin``).
The KV-cache outputs (``present_*``) never reach a loss; a gradient flowing into them is refused.

GroupQueryAttention is differentiated in its prompt form, the one training runs: the query is
the whole sequence (``sequence_length == total_sequence_length``), the past is empty or ignored,
positions start at 0, rows attend keys ``j <= i`` (and ``j > i - local_window_size``), keys past
``seqlens_k[b]`` (right padding) never. A run with a past fails at run time in a node whose
name says so, rather than giving the gradient of another function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto, helper

from .emitter import Emitter
from .registry import RuleContext, RuleError, register

MS = "com.microsoft"
END = np.iinfo(np.int64).max


# ----------------------------------------------------------------------------- rotary
def _slice(em: Emitter, x: str, start: int, end: int, axis: int) -> str:
    return em.op("Slice", [x, em.ints([start]), em.ints([end]), em.ints([axis])], "slice")


def rotate(em: Emitter, x: str, cos: str, sin: str, rotary_dim: int, full: bool, interleaved: bool,
           inverse: bool) -> str:
    """``x`` (rank 4, head_size last) with its first ``rotary_dim`` features rotated by the
    angles whose ``cos``/``sin`` broadcast against ``x[..., :rotary_dim / 2]``; ``full``: the
    rotation covers the whole head. ``inverse``: by the opposite angles (the adjoint)."""
    half = rotary_dim // 2
    part = x if full else _slice(em, x, 0, rotary_dim, -1)
    if interleaved:  # pairs (2i, 2i + 1)
        part = em.op("Reshape", [part, em.ints([0, 0, 0, half, 2])], "pairs")
        x1, x2 = _slice(em, part, 0, 1, -1), _slice(em, part, 1, 2, -1)
        cos, sin = em.unsqueeze(cos, [-1]), em.unsqueeze(sin, [-1])
    else:  # halves (i, i + rotary_dim / 2)
        x1, x2 = _slice(em, part, 0, half, -1), _slice(em, part, half, rotary_dim, -1)
    c1, c2, s1, s2 = (em.op("Mul", [a, b]) for a, b in ((x1, cos), (x2, cos), (x2, sin), (x1, sin)))
    y1, y2 = (em.op("Add", [c1, s1]), em.op("Sub", [c2, s2])) if inverse else \
        (em.op("Sub", [c1, s1]), em.op("Add", [c2, s2]))
    y = em.op("Concat", [y1, y2], "rotated", axis=-1)
    if interleaved:
        y = em.op("Reshape", [y, em.ints([0, 0, 0, rotary_dim])], "rotated")
    if not full:
        y = em.op("Concat", [y, _slice(em, x, rotary_dim, END, -1)], "rotated", axis=-1)
    return y


def _rotary_dim(ctx: RuleContext | Emitter, cos: str) -> int:
    shape = ctx.shape(cos)
    if shape is None or not isinstance(shape[-1], int):
        raise RuleError(f"the shape of the rotary table {cos!r} is unknown")
    return 2 * shape[-1]


def _rotary_embedding(ctx: RuleContext, x: str, positions: str | None, cos: str, sin: str) -> str:
    """The input gradient of a RotaryEmbedding node (contrib or ONNX): ``dY`` rotated back."""
    em, g = ctx.em, ctx.grad(0)
    interleaved = bool(ctx.attr("interleaved", 0))
    num_heads, dim = int(ctx.attr("num_heads", 0) or 0), int(ctx.attr("rotary_embedding_dim", 0) or 0)
    if int(ctx.attr("is_packed_batching", 0) or 0):
        raise RuleError("is_packed_batching=1 (ragged batches) is not differentiated")
    rank = ctx.rank(x)
    rotary_dim = dim or _rotary_dim(ctx, cos)
    if positions is None:  # ONNX's form without position_ids: tables already [B, S, rotary_dim / 2]
        c, s = cos, sin
    elif ctx.rank(positions) == 1:  # contrib: one offset, positions offset + 0..S-1
        length = em.op("Squeeze", [em.dims_of(x, rank - 2 if rank == 4 else 1, rank - 1 if rank == 4 else 2)])
        offset = em.op("Squeeze", [positions])
        pos = em.op("Range", [offset, em.op("Add", [offset, length]), em.const(np.asarray(1, np.int64))], "positions")
        c, s = em.op("Gather", [cos, pos], "cos", axis=0), em.op("Gather", [sin, pos], "sin", axis=0)
    else:  # [B, S]
        c, s = em.op("Gather", [cos, positions], "cos", axis=0), em.op("Gather", [sin, positions], "sin", axis=0)
    if rank == 3:  # [B, S, hidden] -> [B, S, N, head]: tables [B?, S, half] -> [B?, S, 1, half]
        heads = num_heads or None
        if heads is None and dim:
            raise RuleError("a 3-D input with rotary_embedding_dim needs num_heads")
        split = em.ints([0, 0, heads, -1] if heads else [0, 0, -1, rotary_dim])
        g4 = em.op("Reshape", [g, split], "heads")
        dx = rotate(em, g4, em.unsqueeze(c, [-2]), em.unsqueeze(s, [-2]), rotary_dim, not dim, interleaved, True)
        return em.op("Reshape", [dx, em.shape_of(x)], "input_grad")
    if rank != 4:
        raise RuleError(f"RotaryEmbedding input of rank {rank} (3 or 4 expected)")
    if positions is None or ctx.rank(positions) == 2:  # [B, S, half] -> [B, 1, S, half]
        c, s = em.unsqueeze(c, [1]), em.unsqueeze(s, [1])
    return rotate(em, g, c, s, rotary_dim, not dim, interleaved, True)


@register(f"{MS}::RotaryEmbedding", frozen=(2, 3))
def _contrib_rotary(ctx: RuleContext) -> list:
    """onnxruntime's RotaryEmbedding(input, position_ids, cos_cache, sin_cache): input
    ``[B, S, hidden]`` or ``[B, N, S, head]``, position_ids ``[B, S]`` or one offset."""
    x, pos, cos, sin = ctx.node.input[:4]
    return [_rotary_embedding(ctx, x, pos, cos, sin) if ctx.need(0) else None, None, None, None]


@register("RotaryEmbedding", frozen=(1, 2))
def _onnx_rotary(ctx: RuleContext) -> list:
    """ONNX's RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) (opset 23)."""
    x, cos, sin = ctx.node.input[:3]
    return [_rotary_embedding(ctx, x, ctx.input(3), cos, sin) if ctx.need(0) else None] + \
        [None] * (len(ctx.node.input) - 1)


# ----------------------------------------------------------------------------- attention
def _heads(em: Emitter, x: str, heads: int) -> str:
    """``[B, S, heads * d]`` -> ``[B, S, heads, d]``."""
    return em.op("Reshape", [x, em.ints([0, 0, heads, -1])], "heads")


def _grouped(em: Emitter, x4: str, kv_heads: int, groups: int) -> str:
    """``[B, S, kv_heads * groups, d]`` -> ``[B, kv_heads, groups, S, d]``."""
    x5 = em.op("Reshape", [x4, em.ints([0, 0, kv_heads, groups, -1])], "grouped")
    return em.op("Transpose", [x5], "grouped", perm=[0, 2, 3, 1, 4])


def _ungrouped(em: Emitter, x5: str, heads: int) -> str:
    """``[B, kv_heads, groups, S, d]`` -> ``[B, S, heads, d]``."""
    return em.op("Reshape", [em.op("Transpose", [x5], "ungrouped", perm=[0, 3, 1, 2, 4]),
                             em.ints([0, 0, heads, -1])], "ungrouped")


def _kv(em: Emitter, x4: str) -> str:
    """``[B, T, kv_heads, d]`` -> ``[B, kv_heads, 1, T, d]``."""
    return em.unsqueeze(em.op("Transpose", [x4], "kv", perm=[0, 2, 1, 3]), [2])


def _kv_grad(em: Emitter, g5: str) -> str:
    """``[B, kv_heads, groups, T, d]`` summed over the groups -> ``[B, T, kv_heads, d]``."""
    return em.op("Transpose", [em.reduce_sum(g5, [2], keepdims=False)], "kv_grad", perm=[0, 2, 1, 3])


def _probabilities(em: Emitter, q5: str, k5: str, alpha: str, like: str, softcap: float, allowed: str | None,
                   bias: str | None, empty_rows: bool) -> tuple[str, str | None]:
    """``P = softmax(alpha Q Kᵀ (+ bias) [softcapped], keys not allowed left out)`` in the grouped
    layout, and the softcap's ``tanh`` (None without one)."""
    scores = em.op("Mul", [em.op("MatMul", [q5, em.swap_last_two(k5, 5)], "scores"), alpha], "scores")
    if bias is not None:
        scores = em.op("Add", [scores, bias], "scores")
    capped = None
    if softcap > 0:
        capped = em.op("Tanh", [em.op("Mul", [scores, em.scalar(1.0 / softcap, like)])], "softcap")
        scores = em.op("Mul", [capped, em.scalar(softcap, like)], "scores")
    if allowed is not None:  # a finite lowest: exp(lowest - max) is 0, and a row of them stays finite
        lowest = -65504.0 if em.dtype(like) == TensorProto.FLOAT16 else -1e30
        scores = em.op("Where", [allowed, scores, em.scalar(lowest, like)], "masked")
    probs = em.op("Softmax", [scores], "probs", axis=-1)
    if allowed is not None and empty_rows:
        probs = em.op("Where", [allowed, probs, em.scalar(0.0, like)], "probs")
    return probs, capped


def attention(em: Emitter, q4: str, k4: str, v4: str, heads: int, kv_heads: int, alpha: str, like: str,
              softcap: float = 0.0, allowed: str | None = None, bias: str | None = None,
              empty_rows: bool = False) -> str:
    """``O = softmax(alpha Q Kᵀ (+ bias), keys not ``allowed`` left out) V`` as ``[B, S, heads * dv]``
    (the forward :func:`attention_grads` differentiates; same arguments)."""
    groups = heads // kv_heads
    q5, k5, v5 = _grouped(em, q4, kv_heads, groups), _kv(em, k4), _kv(em, v4)
    probs, _ = _probabilities(em, q5, k5, alpha, like, softcap, allowed, bias, empty_rows)
    out = _ungrouped(em, em.op("MatMul", [probs, v5], "attention"), heads)
    return em.op("Reshape", [out, em.ints([0, 0, -1])], "attention")


def attention_grads(em: Emitter, q4: str, k4: str, v4: str, g: str, heads: int, kv_heads: int, alpha: str,
                    like: str, softcap: float = 0.0, allowed: str | None = None, bias: str | None = None,
                    empty_rows: bool = False) -> tuple[str, str, str]:
    """(dQ, dK, dV) of ``O = softmax(alpha Q Kᵀ (+ bias), keys not ``allowed`` left out) V``.

    ``q4`` ``[B, S, heads, d]``, ``k4``/``v4`` ``[B, T, kv_heads, d]`` (as the forward used
    them: rotated), ``g`` = dO ``[B, S, heads * dv]``; ``allowed`` (bool) and ``bias`` broadcast
    against ``[B, kv_heads, groups, S, T]``. ``empty_rows``: a row may have no allowed key (its
    output is 0). ``like``: a value of the computation's element type (the query). The gradients
    come back in the layouts of ``q4``, ``k4``, ``v4``."""
    groups = heads // kv_heads
    q5, k5, v5 = _grouped(em, q4, kv_heads, groups), _kv(em, k4), _kv(em, v4)
    g5 = _grouped(em, _heads(em, g, heads), kv_heads, groups)
    probs, capped = _probabilities(em, q5, k5, alpha, like, softcap, allowed, bias, empty_rows)
    dv = em.op("MatMul", [em.swap_last_two(probs, 5), g5], "dv")
    dp = em.op("MatMul", [g5, em.swap_last_two(v5, 5)], "dp")
    rowsum = em.reduce_sum(em.op("Mul", [dp, probs]), [-1], keepdims=True)
    ds = em.op("Mul", [probs, em.op("Sub", [dp, rowsum])], "ds")
    if capped is not None:
        ds = em.op("Mul", [ds, em.op("Sub", [em.scalar(1.0, like), em.op("Mul", [capped, capped])])], "ds")
    ds = em.op("Mul", [ds, alpha], "ds")
    dq = _ungrouped(em, em.op("MatMul", [ds, k5], "dq"), heads)
    dk = em.op("MatMul", [em.swap_last_two(ds, 5), q5], "dk")
    return dq, _kv_grad(em, dk), _kv_grad(em, dv)


def _alpha(em: Emitter, node: NodeProto, q4: str, head_size: int | None) -> str:
    """The score scale: the node's ``scale``, else ``1 / sqrt(head_size)``."""
    scale = float(_attr(node, "scale", 0.0) or 0.0)
    if scale:
        return em.scalar(scale, node.input[0])
    if head_size is not None:
        return em.scalar(1.0 / math.sqrt(head_size), node.input[0])
    size = em.cast_like(em.op("Shape", [q4], "head_size", start=3, end=4), node.input[0])
    return em.op("Reciprocal", [em.op("Sqrt", [size])], "alpha")


def _attr(node: NodeProto, name: str, default=None):
    found = next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)
    return found.decode() if isinstance(found, bytes) else found


def _input(node: NodeProto, i: int) -> str | None:
    return node.input[i] if i < len(node.input) and node.input[i] else None


def _last_dim(ctx: RuleContext | Emitter, x: str) -> int | None:
    shape = ctx.shape(x)
    return shape[-1] if shape is not None and isinstance(shape[-1], int) else None


def _range(em: Emitter, length: str, dtype=np.int64) -> str:
    """``0..length-1`` (``dtype``) for a ``[1]`` int64 length."""
    end = em.op("Squeeze", [length])
    if dtype != np.int64:
        end = em.op("Cast", [end], "length", to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    return em.op("Range", [em.const(np.asarray(0, dtype)), end, em.const(np.asarray(1, dtype))], "range")


def _refuse(ctx: RuleContext, inputs: dict[int, str], outputs: dict[int, str], attrs: dict[str, str]) -> None:
    """RuleError for an input given, an output with a gradient, or an attribute set to a
    value other than its default, that the rule does not differentiate."""
    for i, what in inputs.items():
        if ctx.input(i) is not None:
            raise RuleError(f"{what} (input {i}) is not differentiated")
    for i, what in outputs.items():
        if ctx.grad(i) is not None:
            raise RuleError(f"a gradient flows into {what} (output {i}); in training only output 0 reaches "
                            "the loss")
    for name, what in attrs.items():
        if ctx.attr(name) not in (None, 0, -1, "NONE"):
            raise RuleError(f"{name}={ctx.attr(name)!r} ({what}) is not differentiated")


@dataclass(frozen=True)
class GroupQuery:
    """A prompt-form GroupQueryAttention node's operands in standard ops (:func:`group_query`):
    query ``q4`` ``[B, S, heads, d]``, key and value ``k4``/``v4`` ``[B, S, kv_heads, d]`` (the
    query and key rotated), the score scale ``alpha`` (checked at run time: the prompt form),
    the keys each row attends ``allowed`` (bool, ``[B, 1, 1, S, S]``), and the rotation by the
    node's angles (None without ``do_rotary``; ``rotation(x, True)``: its adjoint)."""

    q4: str
    k4: str
    v4: str
    heads: int
    kv_heads: int
    alpha: str
    allowed: str
    softcap: float
    window: int
    packed: bool
    rotation: Callable[[str, bool], str] | None

    def output(self, em: Emitter, like: str) -> str:
        """The node's output 0, ``[B, S, heads * d]``."""
        return attention(em, self.q4, self.k4, self.v4, self.heads, self.kv_heads, self.alpha, like, self.softcap,
                         allowed=self.allowed, empty_rows=self.window > 0)


def group_query(em: Emitter, node: NodeProto, what: str) -> GroupQuery:
    """The operands of GroupQueryAttention ``node`` in its prompt form (see the module doc):
    query packed ``[B, S, (H + 2 kvH) d]`` or Q, K, V separate; rotary from ``cos_cache`` /
    ``sin_cache`` at positions ``0..S-1`` (``do_rotary``); causal (``causal=1``),
    ``local_window_size``, ``softcap``, ``scale``; keys past ``seqlens_k[b]`` left out. ``what``
    names the computation in the run-time check's node (a run with a past fails there).

    Raises:
        RuleError: a form it does not cover (``local_window_size`` without ``causal``, an
            unknown rotary table size).
    """
    heads, kv_heads = int(_attr(node, "num_heads")), int(_attr(node, "kv_num_heads"))
    window, softcap = int(_attr(node, "local_window_size", -1)), float(_attr(node, "softcap", 0.0) or 0.0)
    causal, do_rotary = int(_attr(node, "causal", 1)), int(_attr(node, "do_rotary", 0))
    interleaved = bool(_attr(node, "rotary_interleaved", 0))
    query, key, value = node.input[0], _input(node, 1), _input(node, 2)
    packed = key is None
    width = _last_dim(em, query)
    head_size = None if width is None else width // (heads + 2 * kv_heads if packed else heads)

    if packed:
        qkv = _heads(em, query, heads + 2 * kv_heads)
        qk, v4 = _slice(em, qkv, 0, heads + kv_heads, 2), _slice(em, qkv, heads + kv_heads, END, 2)
    else:
        qk, v4 = None, _heads(em, value, kv_heads)
        q4, k4 = _heads(em, query, heads), _heads(em, key, kv_heads)

    rotation = None
    if do_rotary:
        cos, sin = node.input[7], node.input[8]
        rotary_dim = _rotary_dim(em, cos)
        length = em.dims_of(query, 1, 2)
        c = em.unsqueeze(em.op("Slice", [cos, em.ints([0]), length, em.ints([0])], "cos"), [1])  # [S, 1, half]
        s = em.unsqueeze(em.op("Slice", [sin, em.ints([0]), length, em.ints([0])], "sin"), [1])
        full = head_size == rotary_dim

        def rotation(x: str, inverse: bool) -> str:
            return rotate(em, x, c, s, rotary_dim, full, interleaved, inverse)

    if packed:
        qk_rot = rotation(qk, False) if rotation else qk
        q4, k4 = _slice(em, qk_rot, 0, heads, 2), _slice(em, qk_rot, heads, END, 2)
    elif rotation:
        q4, k4 = rotation(q4, False), rotation(k4, False)

    # keys j a row i attends: j <= i (causal), j > i - window, j < seqlens_k[b] + 1 (right padding);
    # in int32, the type of seqlens_k and total_sequence_length (onnxruntime-web's WebGPU runs no
    # int64 arithmetic; with static shapes only the seqlens_k part is left to compute)
    length = em.dims_of(query, 1, 2)
    rows = _range(em, length, np.int32)
    row_i, key_j = em.unsqueeze(rows, [1]), em.unsqueeze(rows, [0])  # [S, 1], [1, S]
    seqlens = em.op("Cast", [node.input[5]], "seqlens", to=TensorProto.INT32)  # int32 already: kept as is
    total = em.op("Add", [seqlens, em.const(np.asarray([1], np.int32), "one")])
    allowed = em.op("Less", [key_j, em.unsqueeze(total, [1, 2])], "in_sequence")  # [B, 1, S]
    if causal:
        allowed = em.op("And", [allowed, em.op("LessOrEqual", [key_j, row_i])], "causal")  # [B, S, S]
        if window > 0:
            shifted = em.op("Sub", [row_i, em.const(np.asarray([window], np.int32), "window")])
            allowed = em.op("And", [allowed, em.op("Greater", [key_j, shifted])], "window")
    elif window > 0:
        raise RuleError("local_window_size with causal=0")
    allowed = em.unsqueeze(allowed, [1, 2])  # [B, 1, 1, S or 1, S]

    total_length = em.op("Cast", [em.op("Reshape", [node.input[6], em.ints([1])])], "total", to=TensorProto.INT32)
    prompt = em.op("Equal", [total_length, em.op("Cast", [length], "length", to=TensorProto.INT32)], "prompt")
    alpha = em.check(prompt, _alpha(em, node, q4, head_size),
                     f"GroupQueryAttention {node.name or node.output[0]!r} {what}: needs its prompt form "
                     "(sequence_length == total_sequence_length, an empty past)")
    return GroupQuery(q4, k4, v4, heads, kv_heads, alpha, allowed, softcap, window, packed, rotation)


GQA_UNCOVERED = ({9: "position_ids", 10: "attention_bias", 11: "head_sink", 12: "k_scale", 13: "v_scale",
                  14: "q_norm_weight", 15: "k_norm_weight", 16: "query_seqlens"},
                 {"smooth_softmax": "a softmax sink", "k_quant_type": "a quantized KV cache",
                  "v_quant_type": "a quantized KV cache"})
"""GroupQueryAttention's inputs (by position) and attributes (at other than their defaults)
that :func:`group_query` does not cover."""


@register(f"{MS}::GroupQueryAttention", frozen=(3, 4, 7, 8))
def _group_query_attention(ctx: RuleContext) -> list:
    """Prompt-form GroupQueryAttention (:func:`group_query`), differentiated."""
    em, g = ctx.em, ctx.grad(0)
    inputs, attrs = GQA_UNCOVERED
    _refuse(ctx, inputs, {1: "present_key", 2: "present_value", 3: "output_qk"}, attrs)
    if any(ctx.need(i) for i in (3, 4, 7, 8)):
        raise RuleError("the past KV cache and the rotary tables do not train")
    gq = group_query(em, ctx.node, "gradient")
    query = ctx.node.input[0]
    dq, dk, dv = attention_grads(em, gq.q4, gq.k4, gq.v4, g, gq.heads, gq.kv_heads, gq.alpha, query, gq.softcap,
                                 allowed=gq.allowed, empty_rows=gq.window > 0)
    out = ctx.empty()
    if gq.packed:
        dqk = em.op("Concat", [dq, dk], "dqk", axis=2)
        if gq.rotation:
            dqk = gq.rotation(dqk, True)
        dqkv = em.op("Concat", [dqk, dv], "dqkv", axis=2)
        out[0] = em.op("Reshape", [dqkv, em.ints([0, 0, -1])], "input_grad")
        return out
    if gq.rotation:
        dq, dk = gq.rotation(dq, True), gq.rotation(dk, True)
    for i, d in enumerate((dq, dk, dv)):
        if ctx.need(i):
            out[i] = em.op("Reshape", [d, em.ints([0, 0, -1])], "input_grad")
    return out


@register(f"{MS}::MultiHeadAttention", frozen=(6, 7))
def _multi_head_attention(ctx: RuleContext) -> list:
    """MultiHeadAttention with query, key, value ``[B, S|L, hidden]``, optional ``bias`` (the three
    projections' biases), ``key_padding_mask`` (``[B, T]`` of 0/1 or ``[B]`` lengths),
    ``attention_bias`` (added to the scores), a past KV cache (keys before the new ones) and
    ``unidirectional``; masked scores get ``mask_filter_value`` added, as onnxruntime does."""
    em, g = ctx.em, ctx.grad(0)
    _refuse(ctx, {8: "past_sequence_length (a shared KV buffer)", 9: "cache_indirection"},
            {1: "present_key", 2: "present_value", 3: "qk"}, {})
    query, key, value, bias = ctx.node.input[0], ctx.input(1), ctx.input(2), ctx.input(3)
    if key is None or value is None or ctx.rank(query) != 3 or ctx.rank(key) != 3 or ctx.rank(value) != 3:
        raise RuleError("only query, key and value of rank 3 ([B, S, hidden], not packed) are differentiated")
    if ctx.need(5) or ctx.need(6) or ctx.need(7):
        raise RuleError("attention_bias and the past KV cache do not train")
    heads = int(ctx.attr("num_heads"))
    filter_value = float(ctx.attr("mask_filter_value", -10000.0) or -10000.0)
    width = _last_dim(ctx, query)
    q, k, v = query, key, value
    if bias is not None:  # [Dq + Dk + Dv]
        sizes = [_last_dim(ctx, x) for x in (query, key, value)]
        if None in sizes:
            raise RuleError("MultiHeadAttention with a bias needs the hidden sizes of query, key and value")
        bq, bk, bv = em.op_n("Split", [bias, em.ints(sizes)], 3, "bias", axis=0)
        q, k, v = em.op("Add", [q, bq]), em.op("Add", [k, bk]), em.op("Add", [v, bv])
    q4, k4, v4 = _heads(em, q, heads), _heads(em, k, heads), _heads(em, v, heads)
    past_k, past_v = ctx.input(6), ctx.input(7)
    if past_k is not None and past_v is not None:  # [B, N, P, d] before the new keys
        k4 = em.op("Concat", [em.op("Transpose", [past_k], perm=[0, 2, 1, 3]), k4], "keys", axis=1)
        v4 = em.op("Concat", [em.op("Transpose", [past_v], perm=[0, 2, 1, 3]), v4], "values", axis=1)
    keys = em.op("Shape", [k4], "keys", start=1, end=2)
    scores_bias = []
    attention_bias = ctx.input(5)
    if attention_bias is not None:  # [B|1, N|1, S, T] -> [B|1, N|1, 1, S, T]
        scores_bias.append(em.unsqueeze(attention_bias, [2]))
    mask = ctx.input(4)
    key_j = em.unsqueeze(_range(em, keys), [0])  # [1, T]
    if mask is not None:
        if ctx.rank(mask) == 2:  # [B, T]: 0 = padding
            keep = em.op("Cast", [mask], "keep", to=TensorProto.BOOL)
        elif ctx.rank(mask) == 1:  # [B]: lengths, right padding
            keep = em.op("Less", [key_j, em.unsqueeze(em.op("Cast", [mask], to=TensorProto.INT64), [1])], "keep")
        else:
            raise RuleError(f"key_padding_mask of rank {ctx.rank(mask)} (1 or 2 expected)")
        scores_bias.append(em.unsqueeze(em.op("Where", [keep, em.scalar(0.0, query), em.scalar(filter_value, query)],
                                              "padding"), [1, 2, 3]))
    if int(ctx.attr("unidirectional", 0)):  # key j > i + (T - S) is the future
        length = em.dims_of(query, 1, 2)
        row_i = em.unsqueeze(em.op("Add", [_range(em, length), em.op("Sub", [keys, length])]), [1])
        future = em.op("Greater", [key_j, row_i], "future")
        scores_bias.append(em.op("Where", [future, em.scalar(filter_value, query), em.scalar(0.0, query)], "causal"))
    total_bias = None
    for b in scores_bias:
        total_bias = b if total_bias is None else em.op("Add", [total_bias, b], "scores_bias")
    head_size = None if width is None else width // heads
    dq, dk, dv = attention_grads(em, q4, k4, v4, g, heads, heads, _alpha(em, ctx.node, q4, head_size), query,
                                 bias=total_bias)
    if past_k is not None and past_v is not None:
        past = em.op("Shape", [past_k], "past", start=2, end=3)
        dk = em.op("Slice", [dk, past, em.ints([END]), em.ints([1])], "new_keys")
        dv = em.op("Slice", [dv, past, em.ints([END]), em.ints([1])], "new_values")
    flat = [em.op("Reshape", [d, em.ints([0, 0, -1])], "input_grad") for d in (dq, dk, dv)]
    out = ctx.empty()
    for i in range(3):
        out[i] = flat[i] if ctx.need(i) else None
    if bias is not None and ctx.need(3):
        sums = [em.reduce_sum(em.op("Reshape", [d, em.ints([-1, size])]), [0], keepdims=False)
                for d, size in zip(flat, sizes)]
        out[3] = em.op("Concat", sums, "bias_grad", axis=0)
    return out
