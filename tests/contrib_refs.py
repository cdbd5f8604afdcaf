"""References for the contrib-op gradient tests: onnxruntime's block-quantized packing, float64
numpy forwards of GroupQueryAttention / MultiHeadAttention / RotaryEmbedding / the fused norms
(checked against onnxruntime's kernels in the tests), and a runner for a Gradient node over
com.microsoft ops (onnxruntime has no float64 kernels for them: the analytic side runs in
float32, the finite differences in float64 on these forwards)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from gradient_utils import finite_difference
from onnx import helper, numpy_helper

from onnx_training_ops.passes.expand_gradient import expand_gradient

TRAINING = "ai.onnx.preview.training"
MS = "com.microsoft"
OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]


# ----------------------------------------------------------------------------- quantization
def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ints ``[..., n]`` -> uint8 ``[..., ceil(n bits / 8)]``, low bits first."""
    per_byte = 8 // bits
    pad = (-values.shape[-1]) % per_byte
    values = np.concatenate([values, np.zeros(values.shape[:-1] + (pad,), values.dtype)], -1)
    values = values.reshape(values.shape[:-1] + (-1, per_byte)).astype(np.uint32)
    return (values << (bits * np.arange(per_byte, dtype=np.uint32))).sum(-1).astype(np.uint8)


def quantized_weight(rng, n: int, k: int, bits: int, block: int, zero_points: str = "uint8",
                     g_idx: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A random MatMulNBits weight: (its float64 ``[N, K]`` dequantization, the initializers
    B, scales and, as asked, zero_points ("uint8", "float" or "none") and g_idx)."""
    blocks = -(-k // block)
    q = rng.integers(0, 2 ** bits, (n, blocks * block))
    scales = rng.uniform(0.01, 0.1, (n, blocks)).astype(np.float32)
    if zero_points == "float":
        zp = rng.uniform(0, 2 ** bits - 1, (n, blocks)).astype(np.float32)
    elif zero_points == "uint8":
        zp = rng.integers(0, 2 ** bits, (n, blocks))
    else:
        zp = np.full((n, blocks), 2 ** (bits - 1))
    block_of = rng.permutation(np.arange(k) // block) if g_idx else np.arange(k) // block
    w = (q[:, :k] - zp[:, block_of]) * scales[:, block_of].astype(np.float64)
    inits = {"B": pack(q, bits).reshape(n, blocks, block * bits // 8), "scales": scales.reshape(-1)}
    if zero_points == "float":
        inits["zero_points"] = zp.reshape(-1)
    elif zero_points == "uint8":
        inits["zero_points"] = pack(zp, bits).reshape(-1)
    if g_idx:
        inits["g_idx"] = block_of.astype(np.int32)
    return w, inits


def matmul_nbits(n: int, k: int, bits: int, block: int, inputs: Sequence[str], accuracy_level: int = 1,
                 a: str = "A", out: str = "Y") -> onnx.NodeProto:
    """A MatMulNBits node reading ``a`` and the named ``inputs`` (B, scales, [zero_points, g_idx, bias])."""
    names = [a, *inputs]
    return helper.make_node("MatMulNBits", names, [out], domain=MS, K=k, N=n, bits=bits, block_size=block,
                            accuracy_level=accuracy_level)


def weight_inputs(inits: Mapping[str, np.ndarray], bias: bool) -> list[str]:
    names = ["B", "scales", "zero_points" if "zero_points" in inits else "", "g_idx" if "g_idx" in inits else "",
             "bias" if bias else ""]
    while names[-1] == "":
        names.pop()
    return names


# ----------------------------------------------------------------------------- running
def _value_info(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))


def _model(nodes, feeds, outputs, initializers, domains=OPSETS) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", [_value_info(k, v) for k, v in feeds.items()],
                              [onnx.ValueInfoProto(name=o) for o in outputs],
                              initializer=[numpy_helper.from_array(np.asarray(v), k)
                                           for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=list(domains))
    model.ir_version = 10
    return model


def session(model: onnx.ModelProto, providers=("CPUExecutionProvider",), **config) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for key, value in config.items():
        setattr(options, key, value)
    return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))


def forward(nodes, feeds: Mapping[str, np.ndarray], out: str, initializers=None) -> np.ndarray:
    """``out`` computed by onnxruntime (float32 kernels)."""
    model = _model(nodes, feeds, [out], dict(initializers or {}))
    return session(model).run([out], dict(feeds))[0]


def gradient_model(nodes, feeds, out: str, xs: Sequence[str], weights: np.ndarray,
                   initializers=None) -> onnx.ModelProto:
    """``y = out * weights`` after ``nodes`` and a Gradient node for ``d sum(y) / d xs``, expanded."""
    nodes = list(nodes) + [helper.make_node("Mul", [out, "loss_weights"], ["y"])]
    grad = helper.make_node("Gradient", list(xs), [f"d_{x}" for x in xs], name="grad", domain=TRAINING,
                            xs=list(xs), y="y")
    inits = dict(initializers or {}, loss_weights=weights.astype(np.float32))
    model = _model(nodes + [grad], feeds, ["y"] + [f"d_{x}" for x in xs], inits,
                   OPSETS + [helper.make_opsetid(TRAINING, 1)])
    expanded = expand_gradient(model)
    expanded.ir_version = 10
    return expanded


def gradients(nodes, feeds, out: str, xs: Sequence[str], weights: np.ndarray, initializers=None,
              providers=("CPUExecutionProvider",)) -> dict[str, np.ndarray]:
    """``{x: d sum(out * weights) / dx}`` by the expanded Gradient, run by onnxruntime in float32."""
    model = gradient_model(nodes, feeds, out, xs, weights, initializers)
    names = [f"d_{x}" for x in xs]
    got = session(model, providers).run(names, {k: v for k, v in feeds.items()})
    return dict(zip(xs, got))


def finite_differences(f, x: np.ndarray, eps: float = 1e-6, samples: int = 48, seed: int = 0) -> tuple:
    """Central differences of the float64 scalar ``f`` at a sample of ``x``'s elements: (indices, values)."""
    return finite_difference(lambda feeds: f(feeds["x"]), {"x": np.array(x, dtype=np.float64)}, "x", eps,
                             max_elements=samples, rng=np.random.default_rng(seed))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


# ----------------------------------------------------------------------------- float64 forwards
def rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """``x [..., head]`` with its first ``2 cos.shape[-1]`` features rotated; cos/sin broadcast
    against ``x[..., :half]``."""
    half = cos.shape[-1]
    y = np.array(x, dtype=np.float64)
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return y


def softmax_rows(scores: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, -1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - top)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def gqa(q, k, v, seqlens_k, heads, kv_heads, cos=None, sin=None, interleaved=False, scale=0.0, window=-1,
        softcap=0.0, causal=True) -> np.ndarray:
    """onnxruntime's GroupQueryAttention in its prompt form (as its CPU kernel computes it in
    onnxruntime 1.32): positions 0..S-1, row i attends keys j <= i, j > i - window,
    j <= seqlens_k[b]; a row with no key gives 0."""
    b, s, _ = q.shape
    head = q.shape[2] // heads
    q = q.reshape(b, s, heads, head)
    k = k.reshape(b, s, kv_heads, head)
    v = v.reshape(b, s, kv_heads, -1)
    if cos is not None:
        c, sn = cos[:s][None, :, None], sin[:s][None, :, None]
        q, k = rotary(q, c, sn, interleaved), rotary(k, c, sn, interleaved)
    group = heads // kv_heads
    k, v = np.repeat(k, group, 2), np.repeat(v, group, 2)
    scores = np.einsum("bshd,bthd->bhst", q, k) * (scale or 1 / np.sqrt(head))
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = (j < (np.asarray(seqlens_k)[:, None, None] + 1))[:, None]  # [B, 1, 1, S]
    if causal:
        allowed = allowed & (j <= i)
        if window > 0:
            allowed = allowed & (j > i - window)
    probs = softmax_rows(scores, allowed)
    return np.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, -1)


def mha(q, k, v, heads, bias=None, mask=None, attention_bias=None, past_k=None, past_v=None,
        unidirectional=False, scale=0.0, filter_value=-10000.0) -> np.ndarray:
    """onnxruntime's MultiHeadAttention on ``[B, S, hidden]`` query/key/value: masked scores
    get ``filter_value`` added."""
    if bias is not None:
        dq, dk = q.shape[-1], k.shape[-1]
        q, k, v = q + bias[:dq], k + bias[dq:dq + dk], v + bias[dq + dk:]
    b, s, _ = q.shape
    head = q.shape[2] // heads
    q = q.reshape(b, s, heads, head)
    k = k.reshape(b, k.shape[1], heads, -1)
    v = v.reshape(b, v.shape[1], heads, -1)
    if past_k is not None:
        k = np.concatenate([past_k.transpose(0, 2, 1, 3), k], 1)
        v = np.concatenate([past_v.transpose(0, 2, 1, 3), v], 1)
    t = k.shape[1]
    scores = np.einsum("bshd,bthd->bhst", q, k) * (scale or 1 / np.sqrt(head))
    if attention_bias is not None:
        scores = scores + attention_bias
    j = np.arange(t)
    if mask is not None:
        keep = mask.astype(bool) if mask.ndim == 2 else j[None] < mask[:, None]
        scores = scores + np.where(keep, 0.0, filter_value)[:, None, None, :]
    if unidirectional:
        scores = scores + np.where(j[None] > np.arange(s)[:, None] + (t - s), filter_value, 0.0)
    return np.einsum("bhst,bthd->bshd", softmax_rows(scores), v).reshape(b, s, -1)


def rms_norm(x, gamma, axes, eps):
    return x / np.sqrt(np.mean(x * x, axis=tuple(axes), keepdims=True) + eps) * gamma


def layer_norm(x, gamma, beta, eps):
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt(np.mean(centered ** 2, -1, keepdims=True) + eps) * gamma + beta
