"""On a GPU (onnxruntime-gpu with the CUDA EP): the contrib-op rules' backward runs on the CUDA EP
and equals the CPU's. Skipped (with the reason) where onnxruntime has no CUDA EP.

What to run on a GPU: ``pytest tests/test_gpu_contrib.py`` (seconds). The float32 chain has a
CUDA kernel for every node; the float16 chain is what ``-e cuda`` builds hold (onnxruntime's CUDA
GroupQueryAttention is float16/bfloat16 only); the genai Llama (``-e cpu``: float32 attention,
lowered to standard ops for CUDA) trains on the CUDA EP in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from contrib_refs import MS, gradient_model, matmul_nbits, quantized_weight, relative_error, session, weight_inputs
from onnx import helper, numpy_helper

pytestmark = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                reason="needs onnxruntime-gpu's CUDAExecutionProvider (no GPU here)")
CUDA = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


def _run(model, feeds, xs, providers):
    return session(model, providers).run([f"d_{x}" for x in xs], feeds)


def _chain(dtype):
    """norm -> MatMulNBits -> attention (MHA + RotaryEmbedding in float32, GQA in float16) -> QuickGelu."""
    rng = np.random.default_rng(0)
    b, s, heads, head, hidden = 2, 8, 2, 16, 32
    attention_width = heads * head * 3
    _, inits = quantized_weight(rng, attention_width, hidden, 4, 16)
    theta = rng.uniform(0, 3, (16, head // 2))
    inits.update(cos=np.cos(theta).astype(np.float32), sin=np.sin(theta).astype(np.float32))
    feeds = {"x": rng.standard_normal((b, s, hidden)).astype(np.float32),
             "skip": rng.standard_normal((b, s, hidden)).astype(np.float32),
             "gamma": rng.uniform(0.5, 1.5, hidden).astype(np.float32)}
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["h"], domain=MS,
                              epsilon=1e-6),
             matmul_nbits(attention_width, hidden, 4, 16, weight_inputs(inits, False), a="h", out="qkv")]
    if dtype == np.float16:  # GQA, packed, rotary, kv heads = heads / 2
        inits.update(seqlens_k=np.array([s - 1, s - 1], np.int32), total=np.array(s, np.int32))
        feeds.update(past_k=np.zeros((b, 1, 0, head), np.float32), past_v=np.zeros((b, 1, 0, head), np.float32))
        nodes += [helper.make_node("Slice", ["qkv", "zero", "width", "last"], ["packed"]),
                  helper.make_node("GroupQueryAttention", ["packed", "", "", "past_k", "past_v", "seqlens_k", "total",
                                                           "cos", "sin"], ["att", "pk", "pv"], domain=MS,
                                   num_heads=heads, kv_num_heads=1, do_rotary=1)]
        inits.update(zero=np.array([0]), width=np.array([(heads + 2) * head]), last=np.array([-1]))
    else:  # MHA (unidirectional) on q, rotary k
        nodes += [helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=-1, num_outputs=3),
                  helper.make_node("RotaryEmbedding", ["k", "positions", "cos", "sin"], ["k_rot"], domain=MS),
                  helper.make_node("MultiHeadAttention", ["q", "k_rot", "v"], ["att"], domain=MS, num_heads=heads,
                                   unidirectional=1)]
        inits["positions"] = np.tile(np.arange(s), (b, 1)).astype(np.int64)
    nodes.append(helper.make_node("QuickGelu", ["att"], ["out"], domain=MS))
    weights = rng.uniform(0.5, 1.5, (b, s, heads * head))
    if dtype == np.float16:
        feeds = {n: v.astype(np.float16) if v.dtype == np.float32 else v for n, v in feeds.items()}
        inits = {n: v.astype(np.float16) if v.dtype == np.float32 else v for n, v in inits.items()}
    model = gradient_model(nodes, feeds, "out", ["x", "skip", "gamma"], weights, inits)
    if dtype == np.float16:
        model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "loss_weights"))
        model.graph.initializer.append(numpy_helper.from_array(weights.astype(np.float16), "loss_weights"))
    return model, feeds


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_contrib_backward_on_cuda(dtype):
    model, feeds = _chain(dtype)
    xs = ["x", "skip", "gamma"]
    gpu, cpu = _run(model, feeds, xs, CUDA), _run(model, feeds, xs, ["CPUExecutionProvider"])
    for name, g, c in zip(xs, gpu, cpu):
        assert relative_error(g, c) < (2e-2 if dtype == np.float16 else 1e-5), name


def test_genai_llama_trains_on_cuda_in_a_cuda_graph():
    """The builder's int4 Llama (float32 activations, LoRA) on the CUDA EP with static shapes:
    its float32 GroupQueryAttention runs in standard ops (onnxruntime's CUDA kernel is float16/
    bfloat16 only), so every node is on the GPU and the step replays a CUDA graph; losses and
    state equal the host session's on the CPU."""
    import warnings

    from genai_fixture import llama_int4

    import onnx_training_ops as ot
    folder = llama_int4()  # kept in the repository: the GPU machine need not have onnxruntime-genai
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ot.add_lora(str(folder), rank=4, alpha=8, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
        trained = ot.build_training_model(model, ot.CrossEntropyLoss(shift_labels=True), ot.AdamW(lr=1e-2))
    shapes = {"input_ids": [2, 10], "attention_mask": [2, 10], "labels": [2, 10]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no node without a CUDA kernel
        gpu = ot.TrainingSession(trained, CUDA, input_shapes=shapes)
    host = ot.TrainingSession(trained)
    assert gpu.cuda_graph, repr(gpu)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = rng.integers(3, 256, (2, 10))
        mask = np.ones_like(ids)
        mask[1, 7:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask == 1, ids, -100)}
        np.testing.assert_allclose(gpu.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-4)
    want = host.state_dict()
    for name, value in gpu.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-2, atol=1e-5, err_msg=name)
