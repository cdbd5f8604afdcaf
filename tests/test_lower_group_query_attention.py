"""Float32 GroupQueryAttention in standard ops for a CUDA device (``passes/lower_group_query_attention.py``):
onnxruntime's CUDA kernel is float16/bfloat16 only, so a ``-e cpu`` onnxruntime-genai build would
run its attention on the CPU in a CUDA step (copies every step, no CUDA graph). The lowered form
computes what onnxruntime's CPU kernel does (every prompt form the rule covers: packed or
separate Q/K/V, rotary, grouped heads, causal, local window, softcap, right padding), its
gradient equals the rule's, and the int4 Llama's device step then has a CUDA kernel for every
node and trains as on the host."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import onnx
import pytest
from contrib_refs import MS, OPSETS, TRAINING, _model, gradients, relative_error, session
from genai_fixture import llama_int4
from onnx import TensorProto, helper
from test_gradient_contrib import GQA

import onnx_training_ops as ot
from onnx_training_ops.passes import GPU_PASSES
from onnx_training_ops.passes.expand_gradient import expand_gradient
from onnx_training_ops.passes.lower_group_query_attention import lower_group_query_attention
from onnx_training_ops.runtime.kernel_table import CUDA, cpu_nodes
from onnx_training_ops.training.engine.config import checked_config
from onnx_training_ops.training.engine.device_graphs import device_step_plans

B, S, HEADS, KV_HEADS = 2, 6, 4, 2


def _case(case: str, read_present: bool = False):
    """The GQA node of ``test_gradient_contrib``'s case, its feeds, initializers and the rows the
    kernel and the float64 forward agree on (see there)."""
    packed, interleaved, rotary_dim, head, scale, window, softcap, padding, causal = GQA[case]
    rng = np.random.default_rng(len(case))
    dq, dkv = HEADS * head, KV_HEADS * head
    x = rng.standard_normal((B, S, dq + 2 * dkv)).astype(np.float32)
    seqlens_k = np.array([S - 1, S - 3 if padding else S - 1], np.int32)
    inits = {"seqlens_k": seqlens_k, "total": np.array(S, np.int32)}
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, scale=scale, local_window_size=window, softcap=softcap,
                 causal=int(causal))
    if rotary_dim:
        theta = rng.uniform(0, 3, (16, rotary_dim // 2))
        inits.update(cos=np.cos(theta).astype(np.float32), sin=np.sin(theta).astype(np.float32))
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved))
    qkv = ["x", "", ""] if packed else ["q", "k", "v"]
    node = helper.make_node("GroupQueryAttention", qkv + ["past_k", "past_v", "seqlens_k", "total"] +
                            (["cos", "sin"] if rotary_dim else []), ["out", "present_k", "present_v"], domain=MS,
                            name="gqa", **attrs)
    empty = np.zeros((B, KV_HEADS, 0, head), np.float32)
    feeds = {"past_k": empty, "past_v": empty}
    feeds.update({"x": x} if packed else {"q": x[..., :dq], "k": x[..., dq:dq + dkv], "v": x[..., dq + dkv:]})
    rows = np.ones((B, S, 1), bool)
    if padding and softcap and window > 0:  # onnxruntime's rows past seqlens_k differ from the function
        rows[1, seqlens_k[1] + 1:] = False
    return node, feeds, inits, rows, ["x"] if packed else ["q", "k", "v"], rng.uniform(0.5, 1.5, (B, S, dq))


def _lowered(model: onnx.ModelProto) -> onnx.ModelProto:
    lowered = lower_group_query_attention(model)
    assert not [n for n in lowered.graph.node if n.op_type == "GroupQueryAttention"]
    return lowered


@pytest.mark.parametrize("case", list(GQA))
def test_the_standard_ops_compute_what_onnxruntimes_kernel_does(case):
    node, feeds, inits, rows, _, _ = _case(case)
    outputs = ["out", "present_k", "present_v"]
    model = _model([node], feeds, outputs, inits)
    kernel = session(model).run(outputs, feeds)
    lowered = _lowered(model)
    assert not cpu_nodes(lowered), cpu_nodes(lowered)  # every node has a CUDA kernel at its types
    ours = session(lowered).run(outputs, feeds)
    assert relative_error(ours[0] * rows, kernel[0] * rows) < 1e-6
    for got, want in zip(ours[1:], kernel[1:]):  # the KV cache: rotated keys, values
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(GQA))
def test_the_gradient_of_the_standard_ops_equals_the_rules(case):
    node, feeds, inits, rows, xs, weights = _case(case)
    weights = weights * rows
    rule = gradients([node], feeds, "out", xs, weights, inits)
    nodes = [node, helper.make_node("Mul", ["out", "loss_weights"], ["y"]),
             helper.make_node("Gradient", xs, [f"d_{x}" for x in xs], domain=TRAINING, xs=xs, y="y")]
    model = _model(nodes, feeds, [f"d_{x}" for x in xs], dict(inits, loss_weights=weights.astype(np.float32)),
                   OPSETS + [helper.make_opsetid(TRAINING, 1)])
    expanded = expand_gradient(_lowered(model))
    expanded.ir_version = 10
    ours = dict(zip(xs, session(expanded).run([f"d_{x}" for x in xs], feeds)))
    for x in xs:
        assert relative_error(ours[x], rule[x]) < 1e-5, x


def test_a_run_with_a_past_fails_in_a_named_node():
    """As the rule: the lowered form is the prompt form's; with a past it fails, saying so."""
    node = helper.make_node("GroupQueryAttention", ["x", "", "", "past_k", "past_v", "seqlens_k", "total"],
                            ["out", "present_k", "present_v"], domain=MS, num_heads=2, kv_num_heads=1)
    feeds = {"x": np.ones((1, 3, 64), np.float32), "past_k": np.ones((1, 1, 2, 16), np.float32),
             "past_v": np.ones((1, 1, 2, 16), np.float32), "seqlens_k": np.array([4], np.int32),
             "total": np.array(5, np.int32)}
    lowered = _lowered(_model([node], feeds, ["out"], {}))
    with pytest.raises(Exception, match=r"\(in standard ops\): needs its prompt form"):
        session(lowered).run(["out"], feeds)


def test_what_the_lowering_leaves_to_onnxruntime():
    """float16 (the CUDA kernel's own type), and forms the rule does not cover (position_ids, the
    output_qk output read) stay GroupQueryAttention nodes."""
    feeds = {"x": np.ones((1, 3, 64), np.float16)}
    inits = {"seqlens_k": np.array([2], np.int32), "total": np.array(3, np.int32), "pos": np.zeros((1, 3), np.int64)}
    half = helper.make_node("GroupQueryAttention", ["x", "", "", "", "", "seqlens_k", "total"], ["out"], domain=MS,
                            num_heads=2, kv_num_heads=1)
    positions = helper.make_node("GroupQueryAttention", ["y", "", "", "", "", "seqlens_k", "total", "", "", "pos"],
                                 ["out2"], domain=MS, num_heads=2, kv_num_heads=1)
    qk = helper.make_node("GroupQueryAttention", ["y", "", "", "", "", "seqlens_k", "total"],
                          ["out3", "", "", "qk"], domain=MS, num_heads=2, kv_num_heads=1)
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT), half, positions, qk], feeds,
                   ["out", "out2", "out3", "qk"], inits)
    kept = [n.output[0] for n in lower_group_query_attention(model).graph.node if n.op_type == "GroupQueryAttention"]
    assert kept == ["out", "out2", "out3"]
    assert ("lower_group_query_attention", lower_group_query_attention) in GPU_PASSES  # CUDA's pipeline


# ----------------------------------------------------------------------------- the genai Llama
@pytest.fixture(scope="module")
def llama():
    """The tiny genai Llama (int4, float32 activations: tests/genai_fixture.py) with LoRA."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ot.add_lora(str(llama_int4()), rank=4, alpha=8, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
        return ot.build_training_model(model, ot.CrossEntropyLoss(shift_labels=True), ot.AdamW(lr=1e-2))


SHAPES = {"input_ids": [2, 10], "attention_mask": [2, 10], "labels": [2, 10]}


def _batches(count: int):
    rng = np.random.default_rng(0)
    for _ in range(count):
        ids = rng.integers(3, 256, (2, 10))
        mask = np.ones_like(ids)
        mask[1, 7:] = 0  # right padding
        yield {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask == 1, ids, -100)}


def test_the_int4_llama_device_step_has_a_cuda_kernel_for_every_node_and_trains_as_on_the_host(llama):
    """Before: its two float32 GroupQueryAttention nodes had no CUDA kernel (and the loss stayed a
    SoftmaxCrossEntropyLoss onnxruntime's CUDA EP has none for: its logits' shape was unknown past
    the int4 LM head); with input_shapes the step did not even build (a stale annotation of the
    genai graph, an untyped contrib output)."""
    [plan] = device_step_plans(llama, SHAPES)
    assert not plan.off_device and plan.graph_capture, plan.off_device
    ops = {n.op_type for n in plan.model.model_proto.graph.node}
    assert "GroupQueryAttention" not in ops and "SoftmaxCrossEntropyLoss" not in ops
    assert {"MatMulNBits", "SkipSimplifiedLayerNormalization"} <= ops  # kept: they have CUDA kernels
    config = checked_config(["CPUExecutionProvider"], None, "raise", None, None, None, "cpu", 0, SHAPES, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no node the CUDA kernels do not cover
        gpu = ot.TrainingSession._opened(llama, dataclasses.replace(config, graphs_for=CUDA))
    host = ot.TrainingSession(llama)
    for batch in _batches(3):
        np.testing.assert_allclose(gpu.step(batch)["loss"], host.step(batch)["loss"], rtol=2e-5)
    want = host.state_dict()
    for name, value in gpu.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-3, atol=1e-6, err_msg=name)
