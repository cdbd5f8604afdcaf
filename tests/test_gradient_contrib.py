"""Derivative rules of onnxruntime's contrib ops (issue 38 item 1): MatMulNBits, GatherBlockQuantized,
GroupQueryAttention, MultiHeadAttention, RotaryEmbedding, the fused norms and activations.

Each rule is checked two ways: against float64 central differences of a numpy forward that the
test first checks against onnxruntime's own kernel (onnxruntime has no float64 kernels for these
ops), and against torch autograd on a reimplementation (``F.linear`` on the dequantized weight,
``scaled_dot_product_attention(enable_gqa=True)`` with transformers' rotary, ...). The expanded
gradient runs in onnxruntime in float32; a node's output is weighted by a random tensor so that a
wrong permutation of the output gradient cannot hide.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from contrib_refs import (
    MS,
    TRAINING,
    _model,
    finite_differences,
    forward,
    gqa,
    gradient_model,
    gradients,
    layer_norm,
    matmul_nbits,
    mha,
    quantized_weight,
    relative_error,
    rms_norm,
    rotary,
    session,
    weight_inputs,
)
from onnx import helper, numpy_helper

import onnx_training_ops as ot
from onnx_training_ops.passes.expand_gradient import expand_gradient

torch = pytest.importorskip("torch")
F = torch.nn.functional

GRAD_RTOL = 2e-5  # float32 analytic gradient vs float64 truth, relative to the largest entry


def _t(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x, np.float64), requires_grad=True)


def _torch_grads(fn, weights, *arrays):
    tensors = [_t(a) for a in arrays]
    (fn(*tensors) * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    return [t.grad.numpy() for t in tensors]


def _check_fd(f64, got: np.ndarray, x: np.ndarray, eps: float = 1e-6) -> float:
    idx, fd = finite_differences(f64, x, eps)
    err = relative_error(got.reshape(-1)[idx], fd)
    assert err < GRAD_RTOL, err
    return err


# ----------------------------------------------------------------------------- MatMulNBits
MATMUL_NBITS = [  # bits, block_size, zero points, g_idx, bias
    (4, 32, "uint8", False, True),
    (4, 16, "none", False, False),
    (4, 128, "float", False, False),
    (4, 256, "uint8", False, False),  # K = 200 < one block: padded
    (4, 64, "none", True, False),
    (4, 32, "float", True, True),
    (8, 32, "uint8", False, False),
    (8, 64, "none", False, True),
    (2, 16, "uint8", False, False),
    (2, 128, "none", False, True),
]


@pytest.mark.parametrize("bits,block,zero_points,g_idx,bias", MATMUL_NBITS)
def test_matmul_nbits_input_gradient(bits, block, zero_points, g_idx, bias):
    """dA = dY · dequant(B) (and dbias) for 2, 4, 8 bits, blocks 16..256, zero points uint8 /
    float / none, with and without g_idx and bias: the kernel's forward equals A · Wᵀ on the
    reference dequantization, the gradient equals differences taken through the kernel itself
    (the op is linear in A) and torch's autograd of F.linear."""
    rng = np.random.default_rng(bits * 1000 + block)
    n, k = 24, 200
    w, inits = quantized_weight(rng, n, k, bits, block, zero_points, g_idx)
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    feeds = {"A": a}
    if bias:
        feeds["bias"] = rng.standard_normal(n).astype(np.float32)
    node = matmul_nbits(n, k, bits, block, weight_inputs(inits, bias))
    weights = rng.uniform(0.5, 1.5, (2, 3, n))
    b64 = feeds["bias"].astype(np.float64) if bias else 0.0
    assert relative_error(forward([node], feeds, "Y", inits), a.astype(np.float64) @ w.T + b64) < 2e-6

    got = gradients([node], feeds, "Y", list(feeds), weights, inits)
    assert relative_error(got["A"], weights @ w) < GRAD_RTOL

    kernel = session(_forward_model(node, feeds, inits))

    def through_kernel(x):
        return float(np.sum(kernel.run(["Y"], dict(feeds, A=x.astype(np.float32)))[0] * weights))
    idx, fd = finite_differences(through_kernel, a, eps=0.25)
    assert relative_error(got["A"].reshape(-1)[idx], fd) < 1e-4

    def linear(x, *rest):
        return F.linear(x, torch.tensor(w), rest[0] if rest else None)
    want = _torch_grads(linear, weights, a, *([feeds["bias"]] if bias else []))
    assert relative_error(got["A"], want[0]) < GRAD_RTOL
    if bias:
        assert relative_error(got["bias"], want[1]) < GRAD_RTOL


def _forward_model(node, feeds, inits):
    return _model([node], feeds, [node.output[0]], inits)


def test_matmul_nbits_accuracy_level_4_is_straight_through():
    """accuracy_level=4 (the genai builder's CPU default) quantizes A to int8 inside the kernel:
    the forward moves, the gradient is the fp32 one, dY · dequant(B), as at accuracy_level=1."""
    rng = np.random.default_rng(4)
    n, k = 32, 128
    w, inits = quantized_weight(rng, n, k, 4, 32)
    a = rng.standard_normal((5, k)).astype(np.float32)
    weights = rng.uniform(0.5, 1.5, (5, n))
    outs, grads = {}, {}
    for level in (1, 4):
        node = matmul_nbits(n, k, 4, 32, weight_inputs(inits, False), accuracy_level=level)
        outs[level] = forward([node], {"A": a}, "Y", inits)
        grads[level] = gradients([node], {"A": a}, "Y", ["A"], weights, inits)["A"]
    exact = a.astype(np.float64) @ w.T
    assert relative_error(outs[1], exact) < 1e-6 < relative_error(outs[4], exact) < 3e-2
    np.testing.assert_array_equal(grads[1], grads[4])
    assert relative_error(grads[4], weights @ w) < GRAD_RTOL


def test_matmul_nbits_dequantizes_in_the_backward_pass_not_at_session_creation(tmp_path):
    """The backward's dequantized weight is made at run time from an index read from dY:
    onnxruntime's optimizer keeps the GatherBlockQuantized node instead of folding it into a
    float [N, K] initializer (which, for every layer of a large model, would hold the whole
    base in float32 for the session's life)."""
    rng = np.random.default_rng(5)
    n, k = 64, 96
    _, inits = quantized_weight(rng, n, k, 4, 32)
    node = matmul_nbits(n, k, 4, 32, weight_inputs(inits, False))
    model = gradient_model([node], {"A": np.ones((2, k), np.float32)}, "Y", ["A"], np.ones((2, n)), inits)
    optimized = tmp_path / "optimized.onnx"
    session(model, optimized_model_filepath=str(optimized))
    graph = onnx.load(optimized).graph
    assert any(nd.op_type == "GatherBlockQuantized" for nd in graph.node)
    assert not [t.name for t in graph.initializer
                if int(np.prod(t.dims)) >= n * k and t.data_type == onnx.TensorProto.FLOAT]


def test_matmul_nbits_g_idx_with_uint8_zero_points_is_refused():
    """onnxruntime 1.32's CPU kernel ignores uint8 zero points when g_idx is given (it uses 8),
    so no gradient matches both the kernel and the op's definition: the rule says so."""
    rng = np.random.default_rng(6)
    _, inits = quantized_weight(rng, 8, 64, 4, 32, "uint8", g_idx=True)
    node = matmul_nbits(8, 64, 4, 32, weight_inputs(inits, False))
    with pytest.raises(ot.TrainingOpError, match="g_idx"):
        gradient_model([node], {"A": np.ones((2, 64), np.float32)}, "Y", ["A"], np.ones((2, 8)), inits)


# ----------------------------------------------------------------------------- the builder around them
def _lm_with_quantized_head(inits, extra_nodes=(), extra_inits=None):
    """x [B, K] -> norm (trainable weight) -> MatMulNBits (frozen) -> logits."""
    k = 64
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "norm.weight"], ["h"], epsilon=1e-6),
             matmul_nbits(16, k, 4, 32, weight_inputs(inits, False), a="h", out="logits"), *extra_nodes]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", k])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["B", 16])],
                              initializer=[numpy_helper.from_array(np.asarray(v), n) for n, v in
                                           {**inits, "norm.weight": np.linspace(0.5, 1.5, k, dtype=np.float32),
                                            **(extra_inits or {})}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model


def test_default_trainables_leave_the_quantized_weight_out_and_naming_it_is_an_error():
    rng = np.random.default_rng(7)
    _, inits = quantized_weight(rng, 16, 64, 4, 32)
    model = _lm_with_quantized_head(inits)
    trained = ot.build_training_model(model, "mse", ot.Adam(lr=0.1))
    bindings = {e.key for e in trained.training_info[0].update_binding}
    assert "norm.weight" in bindings and "scales" not in bindings
    with pytest.raises(ot.TrainingOpError, match=r"'scales' is input 2 of MatMulNBits node"):
        ot.build_training_model(model, "mse", ot.Adam(lr=0.1), trainable=["norm.weight", "scales"])


def test_a_contrib_op_without_a_rule_is_named():
    """The derivative-coverage check at build time names an onnxruntime op with no rule (op and
    node)."""
    rng = np.random.default_rng(8)
    _, inits = quantized_weight(rng, 16, 64, 4, 32)
    unknown = helper.make_node("BiasSoftmax", ["logits0", "zeros"], ["logits"], domain=MS, name="odd_softmax")
    model = _lm_with_quantized_head(inits, [unknown], {"zeros": np.zeros(16, np.float32)})
    model.graph.node[1].output[0] = "logits0"
    with pytest.raises(ot.TrainingOpError, match=r"com\.microsoft::BiasSoftmax x1 \(first: 'odd_softmax'\)"):
        ot.build_training_model(model, "mse", ot.Adam(lr=0.1))


def test_gather_block_quantized_table_is_frozen():
    """A tied quantized embedding (GatherBlockQuantized) gets no gradient; naming its scales
    trainable is refused."""
    rng = np.random.default_rng(9)
    _, inits = quantized_weight(rng, 16, 64, 4, 32)
    table = inits["B"].reshape(16, -1)
    gather = helper.make_node("GatherBlockQuantized", ["table", "ids", "scales2"], ["x"], domain=MS, bits=4,
                              block_size=32, gather_axis=0, quantize_axis=1)
    model = _lm_with_quantized_head(inits, extra_inits={"table": table, "scales2": inits["scales"].reshape(16, 2)})
    model.graph.node.insert(0, gather)
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["B"]))
    trained = ot.build_training_model(model, "mse", ot.Adam(lr=0.1))
    assert {e.key for e in trained.training_info[0].update_binding} >= {"norm.weight"}
    assert "scales2" not in {e.key for e in trained.training_info[0].update_binding}
    with pytest.raises(ot.TrainingOpError, match="GatherBlockQuantized"):
        ot.build_training_model(model, "mse", ot.Adam(lr=0.1), trainable=["scales2"])


# ----------------------------------------------------------------------------- GroupQueryAttention
def _torch_rotary(x, cos, sin, interleaved):
    """transformers' rotary on ``x`` [B, S, N, head] at positions 0..S-1: Llama's rotate_half
    form, GPT-J's rotate_every_two form when interleaved; the first 2 * half features."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary
    s, rd = x.shape[1], 2 * cos.shape[1]
    c, sn = torch.tensor(cos[:s], dtype=torch.float64)[None], torch.tensor(sin[:s], dtype=torch.float64)[None]
    part, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        rotated = gptj_rotary(part, sn, c)
    else:
        bnsd = part.transpose(1, 2)
        rotated, _ = llama_rotary(bnsd, bnsd, torch.cat([c, c], -1), torch.cat([sn, sn], -1))
        rotated = rotated.transpose(1, 2)
    return torch.cat([rotated, rest], -1)


def torch_gqa(q, k, v, seqlens_k, heads, kv_heads, cos, sin, interleaved, scale, window, softcap, causal):
    """GroupQueryAttention in torch: transformers' rotary, scaled_dot_product_attention with
    enable_gqa (softcap: the eager form of transformers' Gemma 2, in float64)."""
    b, s, _ = q.shape
    head = q.shape[2] // heads
    q, k, v = q.view(b, s, heads, head), k.view(b, s, kv_heads, head), v.view(b, s, kv_heads, -1)
    if cos is not None:
        q, k = _torch_rotary(q, cos, sin, interleaved), _torch_rotary(k, cos, sin, interleaved)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j < torch.tensor(seqlens_k, dtype=torch.int64)[:, None, None] + 1)[:, None]
    if causal:
        allowed = allowed & (j <= i) & ((j > i - window) if window > 0 else True)
    alpha = scale or head ** -0.5
    if softcap == 0 and bool(allowed.any(-1).all()):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=alpha, enable_gqa=True)
    else:
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(2, 3) * alpha
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out = probs @ v
    return out.transpose(1, 2).reshape(b, s, -1)


GQA = {  # packed, interleaved, rotary_dim (0: no rotary), head_size, scale, window, softcap, padding, causal
    "packed": (True, False, 16, 16, 0.3, -1, 0.0, False, True),
    "packed_interleaved_window_padding": (True, True, 16, 16, 0.3, 3, 0.0, True, True),
    "separate_partial_rotary_softcap_padding": (False, False, 16, 32, 0.0, -1, 4.0, True, True),
    "separate_interleaved_partial_window_softcap": (False, True, 16, 32, 0.2, 2, 2.0, False, True),
    "packed_window_padding_empty_rows": (True, False, 16, 16, 0.3, 2, 3.0, True, True),
    "no_rotary_not_causal_padding": (True, False, 0, 16, 0.3, -1, 0.0, True, False),
}


@pytest.mark.parametrize("case", list(GQA))
def test_group_query_attention(case):
    """Prompt-form GQA (4 query heads over 2 KV heads) as the genai builder emits it: the kernel
    agrees with the float64 forward on every row (right padding included; with softcap and a
    local window together, on the rows up to seqlens_k only: the loss then reads only those, as a
    causal-LM loss ignoring padding does), the gradient with differences of that forward and
    with torch."""
    packed, interleaved, rotary_dim, head, scale, window, softcap, padding, causal = GQA[case]
    rng = np.random.default_rng(len(case))
    b, s, heads, kv_heads = 2, 6, 4, 2
    dq, dkv = heads * head, kv_heads * head
    x = rng.standard_normal((b, s, dq + 2 * dkv)).astype(np.float32)
    seqlens_k = np.array([s - 1, s - 3 if padding else s - 1], np.int32)
    cos = sin = None
    inits = {"seqlens_k": seqlens_k, "total": np.array(s, np.int32)}
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=scale, local_window_size=window, softcap=softcap,
                 causal=int(causal))
    if rotary_dim:
        theta = rng.uniform(0, 3, (16, rotary_dim // 2))
        cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        inits.update(cos=cos, sin=sin)
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved))
    qkv = ["x", "", ""] if packed else ["q", "k", "v"]
    node = helper.make_node("GroupQueryAttention", qkv + ["past_k", "past_v", "seqlens_k", "total"] +
                            (["cos", "sin"] if rotary_dim else []), ["out", "present_k", "present_v"], domain=MS,
                            **attrs)
    feeds = {"past_k": np.zeros((b, kv_heads, 0, head), np.float32), "past_v": np.zeros((b, kv_heads, 0, head),
                                                                                        np.float32)}
    parts = {"q": x[..., :dq], "k": x[..., dq:dq + dkv], "v": x[..., dq + dkv:]}
    feeds.update({"x": x} if packed else parts)
    xs = ["x"] if packed else ["q", "k", "v"]
    weights = rng.uniform(0.5, 1.5, (b, s, dq))

    def ref(q, k, v, lib=np):
        call = gqa if lib is np else torch_gqa
        return call(q, k, v, seqlens_k, heads, kv_heads, cos, sin, interleaved, scale, window, softcap, causal)

    if padding and softcap and window > 0:  # the kernel's rows past seqlens_k differ: keep them out of the loss
        weights[1, seqlens_k[1] + 1:] = 0.0
    x64 = x.astype(np.float64)
    want_out = ref(x64[..., :dq], x64[..., dq:dq + dkv], x64[..., dq + dkv:])
    assert relative_error(forward([node], feeds, "out", inits) * (weights != 0), want_out * (weights != 0)) < 2e-6
    got = gradients([node], feeds, "out", xs, weights, inits)
    analytic = got["x"] if packed else np.concatenate([got[n] for n in xs], -1)

    def f64(z):
        return float(np.sum(ref(z[..., :dq], z[..., dq:dq + dkv], z[..., dq + dkv:]) * weights))
    _check_fd(f64, analytic, x64)
    want = _torch_grads(lambda q, k, v: ref(q, k, v, torch), weights, *parts.values())
    assert relative_error(analytic, np.concatenate(want, -1)) < GRAD_RTOL


def test_group_query_attention_with_a_past_fails_in_a_named_node():
    """A run with a past (sequence_length != total_sequence_length) is not the function the rule
    differentiates: the gradient fails at run time, naming why, instead of being wrong."""
    b, s, heads, kv_heads, head = 1, 3, 2, 1, 16
    node = helper.make_node("GroupQueryAttention", ["x", "", "", "past_k", "past_v", "seqlens_k", "total"],
                            ["out", "present_k", "present_v"], domain=MS, num_heads=heads, kv_num_heads=kv_heads)
    for past in (0, 2):
        feeds = {"x": np.ones((b, s, (heads + 2 * kv_heads) * head), np.float32),
                 "past_k": np.ones((b, kv_heads, past, head), np.float32),
                 "past_v": np.ones((b, kv_heads, past, head), np.float32),
                 "seqlens_k": np.array([s + past - 1], np.int32), "total": np.array(s + past, np.int32)}
        run = session(gradient_model([node], feeds, "out", ["x"], np.ones((b, s, heads * head)))).run
        if past:
            with pytest.raises(Exception, match="gradient: needs its prompt form"):
                run(["d_x"], feeds)
        else:
            assert np.isfinite(run(["d_x"], feeds)[0]).all()


# ----------------------------------------------------------------------------- MultiHeadAttention
def torch_mha(q, k, v, heads, bias=None, mask=None, attention_bias=None, past_k=None, past_v=None,
              unidirectional=False, scale=0.0, filter_value=-10000.0):
    if bias is not None:
        dq, dk = q.shape[-1], k.shape[-1]
        q, k, v = q + bias[:dq], k + bias[dq:dq + dk], v + bias[dq + dk:]
    b, s, _ = q.shape
    head = q.shape[2] // heads
    q = q.view(b, s, heads, head).transpose(1, 2)
    k = k.view(b, k.shape[1], heads, -1).transpose(1, 2)
    v = v.view(b, v.shape[1], heads, -1).transpose(1, 2)
    if past_k is not None:
        k = torch.cat([torch.tensor(past_k, dtype=torch.float64), k], 2)
        v = torch.cat([torch.tensor(past_v, dtype=torch.float64), v], 2)
    t = k.shape[2]
    add = torch.zeros(b, 1, s, t, dtype=torch.float64)
    if attention_bias is not None:
        add = add + torch.tensor(attention_bias, dtype=torch.float64)
    j = torch.arange(t)
    if mask is not None:
        keep = torch.tensor(mask).bool() if mask.ndim == 2 else j[None] < torch.tensor(mask)[:, None]
        add = add + torch.where(keep, 0.0, filter_value)[:, None, None, :].double()
    if unidirectional:
        add = add + torch.where(j[None] > torch.arange(s)[:, None] + (t - s), filter_value, 0.0).double()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale or head ** -0.5)
    return out.transpose(1, 2).reshape(b, s, -1)


MHA = {  # bias, key_padding_mask ("2d", "1d", None), attention_bias, past, unidirectional, kv length
    "plain": (False, None, False, False, False, 5),
    "bias_mask_causal": (True, "2d", False, False, True, 5),
    "cross_lengths_attention_bias": (False, "1d", True, False, False, 7),
    "past_causal_bias": (True, None, False, True, True, 5),
}


@pytest.mark.parametrize("case", list(MHA))
def test_multi_head_attention(case):
    has_bias, mask_kind, has_attention_bias, has_past, unidirectional, kv_len = MHA[case]
    rng = np.random.default_rng(len(case) + 100)
    b, s, heads, head, past = 2, 5, 2, 8, 3
    hidden = heads * head
    q, k, v = (rng.standard_normal((b, n, hidden)).astype(np.float32) for n in (s, kv_len, kv_len))
    feeds = {"q": q, "k": k, "v": v}
    names = ["q", "k", "v", "", "", "", "", ""]
    extra = {}
    if has_bias:
        feeds["bias"] = rng.standard_normal(3 * hidden).astype(np.float32)
        names[3] = "bias"
    total = kv_len + (past if has_past else 0)
    if mask_kind == "2d":
        extra["mask"] = np.ones((b, total), np.int32)
        extra["mask"][1, -2:] = 0
    elif mask_kind == "1d":
        extra["mask"] = np.array([total, total - 2], np.int32)
    if mask_kind:
        names[4] = "mask"
    if has_attention_bias:
        extra["attention_bias"] = rng.standard_normal((1, heads, s, total)).astype(np.float32)
        names[5] = "attention_bias"
    if has_past:
        extra["past_k"] = rng.standard_normal((b, heads, past, head)).astype(np.float32)
        extra["past_v"] = rng.standard_normal((b, heads, past, head)).astype(np.float32)
        names[6:8] = ["past_k", "past_v"]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("MultiHeadAttention", names, ["out"] + (["present_k", "present_v"] if has_past else []),
                            domain=MS, num_heads=heads, unidirectional=int(unidirectional))
    weights = rng.uniform(0.5, 1.5, (b, s, hidden))
    kw = dict(mask=extra.get("mask"), attention_bias=extra.get("attention_bias"), past_k=extra.get("past_k"),
              past_v=extra.get("past_v"), unidirectional=unidirectional)
    f64 = {n: a.astype(np.float64) for n, a in feeds.items()}
    assert relative_error(forward([node], feeds, "out", extra), mha(*(f64[n] for n in "qkv"), heads,
                                                                   bias=f64.get("bias"), **kw)) < 2e-6
    got = gradients([node], feeds, "out", list(feeds), weights, extra)
    for name in feeds:
        def f(z, name=name):
            args = dict(f64, **{name: z})
            return float(np.sum(mha(args["q"], args["k"], args["v"], heads, bias=args.get("bias"), **kw) * weights))
        _check_fd(f, got[name], f64[name])
    want = _torch_grads(lambda *t: torch_mha(*t[:3], heads, t[3] if has_bias else None, **kw), weights,
                        *feeds.values())
    for name, w in zip(feeds, want):
        assert relative_error(got[name], w) < GRAD_RTOL, name


# ----------------------------------------------------------------------------- RotaryEmbedding
ROTARY = {  # layout, positions, interleaved, rotary_embedding_dim (0: the whole head)
    "bsh_positions": ("bsh", "bs", False, 0),
    "bnsh_offset_interleaved": ("bnsh", "offset", True, 0),
    "bsh_partial_interleaved": ("bsh", "bs", True, 16),
}


@pytest.mark.parametrize("case", list(ROTARY))
def test_rotary_embedding(case):
    """onnxruntime's RotaryEmbedding: input [B, S, hidden] or [B, N, S, head], position_ids [B, S]
    or one offset, interleaved or not, partial (rotary_embedding_dim with num_heads)."""
    layout, positions, interleaved, dim = ROTARY[case]
    rng = np.random.default_rng(len(case))
    b, s, heads, head = 2, 5, 2, 32 if dim else 16
    rotary_dim = dim or head
    theta = rng.uniform(0, 3, (20, rotary_dim // 2))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    shape = (b, s, heads * head) if layout == "bsh" else (b, heads, s, head)
    x = rng.standard_normal(shape).astype(np.float32)
    pos = rng.integers(0, 20, (b, s)) if positions == "bs" else np.array([4])
    at = pos if positions == "bs" else np.broadcast_to(4 + np.arange(s), (b, s))
    attrs = dict(interleaved=int(interleaved))
    if dim:
        attrs.update(rotary_embedding_dim=dim, num_heads=heads)
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["out"], domain=MS, **attrs)
    feeds = {"x": x, "pos": pos.astype(np.int64)}
    inits = {"cos": cos, "sin": sin}

    def ref(z):
        c, sn = cos[at].astype(np.float64), sin[at].astype(np.float64)
        if layout == "bsh":
            return rotary(z.reshape(b, s, heads, head), c[:, :, None], sn[:, :, None], interleaved).reshape(shape)
        return rotary(z, c[:, None], sn[:, None], interleaved)
    weights = rng.uniform(0.5, 1.5, shape)
    assert relative_error(forward([node], feeds, "out", inits), ref(x.astype(np.float64))) < 2e-6
    got = gradients([node], feeds, "out", ["x"], weights, inits)["x"]
    _check_fd(lambda z: float(np.sum(ref(z) * weights)), got, x.astype(np.float64))


def test_onnx_rotary_embedding_against_the_reference_evaluator():
    """ONNX's own RotaryEmbedding (opset 23): float64 differences through onnx.reference."""
    from onnx.reference import ReferenceEvaluator
    rng = np.random.default_rng(23)
    b, heads, s, head = 2, 2, 4, 8
    x = rng.standard_normal((b, heads, s, head))
    theta = rng.uniform(0, 3, (10, head // 2))
    pos = rng.integers(0, 10, (b, s)).astype(np.int64)
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], interleaved=1)
    weights = rng.uniform(0.5, 1.5, x.shape)
    inits = {"cos": np.cos(theta), "sin": np.sin(theta)}
    graph = helper.make_graph([node], "r", [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, x.shape),
                                            helper.make_tensor_value_info("pos", onnx.TensorProto.INT64, pos.shape)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
                              initializer=[numpy_helper.from_array(v, n) for n, v in inits.items()])
    ref = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    f = lambda z: float(np.sum(ref.run(None, {"x": z, "pos": pos})[0] * weights))  # noqa: E731
    grad = helper.make_node("Gradient", ["x"], ["d_x"], domain=TRAINING, xs=["x"], y="yw", name="g")
    model = _model([node, helper.make_node("Mul", ["y", "w"], ["yw"]), grad], {"x": x, "pos": pos}, ["d_x"],
                   {**inits, "w": weights}, [helper.make_opsetid("", 23), helper.make_opsetid(TRAINING, 1)])
    got = ReferenceEvaluator(expand_gradient(model)).run(None, {"x": x, "pos": pos})[0]
    idx, fd = finite_differences(f, x)
    assert relative_error(got.reshape(-1)[idx], fd) < 1e-8


# ----------------------------------------------------------------------------- norms and activations
NORMS = ["simplified_last", "simplified_two_axes", "skip_simplified", "skip_simplified_bias_sum",
         "skip_layer_norm", "skip_layer_norm_beta_bias_sum"]


@pytest.mark.parametrize("case", NORMS)
def test_fused_norms(case):
    """SimplifiedLayerNormalization (RMSNorm over [axis, rank)), SkipSimplifiedLayerNormalization
    and SkipLayerNormalization: every input (input, skip, gamma, beta, bias), output 0 and the
    residual sum (output 3) both read."""
    rng = np.random.default_rng(len(case))
    x = rng.standard_normal((2, 3, 4, 8) if case == "simplified_two_axes" else (2, 3, 8)).astype(np.float32)
    eps = 1e-5
    if case.startswith("simplified"):
        axes = [-2, -1] if case == "simplified_two_axes" else [-1]
        feeds = {"x": x, "gamma": rng.uniform(0.5, 1.5, x.shape[len(x.shape) - len(axes):]).astype(np.float32)}
        nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["out"], axis=axes[0],
                                  epsilon=eps)]

        def ref(v):
            return rms_norm(v["x"], v["gamma"], axes, eps)
        want_t = lambda t: t["x"] / torch.sqrt((t["x"] ** 2).mean(axes, keepdim=True) + eps) * t["gamma"]  # noqa: E731
    else:
        centered = case.startswith("skip_layer_norm")
        with_extras = case.endswith("sum")
        h = x.shape[-1]
        feeds = {"x": x, "skip": rng.standard_normal(x.shape).astype(np.float32),
                 "gamma": rng.uniform(0.5, 1.5, h).astype(np.float32)}
        names = ["x", "skip", "gamma"]
        if centered:
            feeds["beta"] = rng.standard_normal(h).astype(np.float32) if with_extras else None
            names.append("beta" if with_extras else "")
        if with_extras:
            feeds["bias"] = rng.standard_normal(h).astype(np.float32)
            names.append("bias")
        feeds = {n: v for n, v in feeds.items() if v is not None}
        while names[-1] == "":
            names.pop()
        op = "SkipLayerNormalization" if centered else "SkipSimplifiedLayerNormalization"
        nodes = [helper.make_node(op, names, ["normed", "", "", "sum"] if with_extras else ["out"], domain=MS,
                                  epsilon=eps)]
        if with_extras:
            nodes += [helper.make_node("Mul", ["sum", "half"], ["sum_half"]),
                      helper.make_node("Add", ["normed", "sum_half"], ["out"])]

        def ref(v):
            s = v["x"] + v["skip"] + v.get("bias", 0.0)
            y = layer_norm(s, v["gamma"], v.get("beta", 0.0), eps) if centered else rms_norm(s, v["gamma"], [-1], eps)
            return y + 0.5 * s if with_extras else y

        def want_t(t):
            s = t["x"] + t["skip"] + t.get("bias", 0.0)
            y = (F.layer_norm(s, (h,), t["gamma"], t.get("beta"), eps) if centered else
                 s / torch.sqrt((s ** 2).mean(-1, keepdim=True) + eps) * t["gamma"])
            return y + 0.5 * s if with_extras else y
    inits = {"half": np.float32(0.5)} if case.endswith("sum") else {}
    weights = rng.uniform(0.5, 1.5, x.shape)
    f64 = {n: v.astype(np.float64) for n, v in feeds.items()}
    assert relative_error(forward(nodes, feeds, "out", inits), ref(f64)) < 2e-6
    got = gradients(nodes, feeds, "out", list(feeds), weights, inits)
    for name in feeds:
        _check_fd(lambda z, name=name: float(np.sum(ref(dict(f64, **{name: z})) * weights)), got[name], f64[name])
    names = list(feeds)
    want = _torch_grads(lambda *t: want_t(dict(zip(names, t))), weights, *feeds.values())
    for name, w in zip(names, want):
        assert relative_error(got[name], w) < GRAD_RTOL, name


ACTIVATIONS = {
    "QuickGelu": (lambda v: v["x"] / (1 + np.exp(-1.5 * v["x"])), lambda t: t["x"] * torch.sigmoid(1.5 * t["x"])),
    "BiasGelu": (None, lambda t: F.gelu(t["x"] + t["bias"])),
    "FastGelu": (None, lambda t: F.gelu(t["x"] + t["bias"], approximate="tanh")),
}


@pytest.mark.parametrize("op", list(ACTIVATIONS))
def test_contrib_activations(op):
    """QuickGelu (x sigmoid(alpha x)), BiasGelu (erf GELU of x + bias), FastGelu with its bias (tanh GELU)."""
    from math import erf
    rng = np.random.default_rng(len(op))
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32)}
    if op != "QuickGelu":
        feeds["bias"] = rng.standard_normal(8).astype(np.float32)
    node = helper.make_node(op, list(feeds), ["out"], domain=MS, **({"alpha": 1.5} if op == "QuickGelu" else {}))
    numpy_ref, torch_ref = ACTIVATIONS[op]
    if numpy_ref is None:
        def numpy_ref(v):
            z = v["x"] + v["bias"]
            if op == "BiasGelu":
                return 0.5 * z * (1 + np.vectorize(erf)(z / np.sqrt(2)))
            return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    weights = rng.uniform(0.5, 1.5, (3, 8))
    f64 = {n: v.astype(np.float64) for n, v in feeds.items()}
    assert relative_error(forward([node], feeds, "out"), numpy_ref(f64)) < 2e-6
    got = gradients([node], feeds, "out", list(feeds), weights)
    for name in feeds:
        _check_fd(lambda z, name=name: float(np.sum(numpy_ref(dict(f64, **{name: z})) * weights)), got[name],
                  f64[name])
    names = list(feeds)
    for name, w in zip(names, _torch_grads(lambda *t: torch_ref(dict(zip(names, t))), weights, *feeds.values())):
        assert relative_error(got[name], w) < GRAD_RTOL, name


def test_float16_graph_runs_and_agrees_with_float32():
    """The CUDA builder's graphs compute in float16 (activations, scales, norms, rotary tables):
    the rules emit float16 ops (a float16 mask fill, GatherBlockQuantized to float16), and the
    gradient of a norm -> MatMulNBits -> GroupQueryAttention chain agrees with its float32 twin."""
    rng = np.random.default_rng(16)
    b, s, heads, kv_heads, head, hidden = 2, 5, 2, 1, 16, 32
    width = (heads + 2 * kv_heads) * head
    _, inits32 = quantized_weight(rng, width, hidden, 4, 16)
    theta = rng.uniform(0, 3, (8, head // 2))
    inits32.update(cos=np.cos(theta).astype(np.float32), sin=np.sin(theta).astype(np.float32),
                   seqlens_k=np.array([s - 1, s - 2], np.int32), total=np.array(s, np.int32))
    feeds32 = {"x": rng.standard_normal((b, s, hidden)).astype(np.float32),
               "skip": rng.standard_normal((b, s, hidden)).astype(np.float32),
               "gamma": rng.uniform(0.5, 1.5, hidden).astype(np.float32),
               "past_k": np.zeros((b, kv_heads, 0, head), np.float32),
               "past_v": np.zeros((b, kv_heads, 0, head), np.float32)}
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["h"], domain=MS,
                              epsilon=1e-6),
             matmul_nbits(width, hidden, 4, 16, weight_inputs(inits32, False), a="h", out="qkv"),
             helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total", "cos",
                                                      "sin"], ["out", "pk", "pv"], domain=MS, num_heads=heads,
                              kv_num_heads=kv_heads, do_rotary=1)]
    weights = rng.uniform(0.5, 1.5, (b, s, heads * head))
    xs = ["x", "skip", "gamma"]
    want = gradients(nodes, feeds32, "out", xs, weights, inits32)
    half = {n: v.astype(np.float16) if v.dtype == np.float32 else v for n, v in feeds32.items()}
    inits16 = {n: v.astype(np.float16) if v.dtype == np.float32 else v for n, v in inits32.items()}
    model = gradient_model(nodes, half, "out", xs, weights, inits16)
    for node in model.graph.node:  # the loss weights in float16 too
        if node.op_type == "Mul" and "loss_weights" in node.input:
            next(t for t in model.graph.initializer if t.name == "loss_weights").CopyFrom(
                numpy_helper.from_array(weights.astype(np.float16), "loss_weights"))
    got = dict(zip(xs, session(model).run([f"d_{x}" for x in xs], half)))
    for name in xs:
        assert got[name].dtype == np.float16
        assert relative_error(got[name], want[name]) < 2e-2, name
