"""A ``MatMulNBits`` whose weight a training session binds as an input (issue 38, the int4 step on
the CPU): passes/dequantize_matmul_nbits.py computes what onnxruntime's prepacked kernel (the
deployed model) computes, ``accuracy_level=4``'s int8 activations included, by row ranges; the
native kernels (kernels/_native_dequant_kernels.py) give ``GatherBlockQuantized``'s values and
the standard-op rounding's; a large model's session trains as the same model held in its
message (whose weights onnxruntime prepacks)."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_refs import _model, matmul_nbits, quantized_weight, session
from onnx import TensorProto, helper

import onnx_training_ops.autodiff.rules_quantized as rules_quantized
from onnx_training_ops.autodiff.emitter import Emitter, ValueMeta
from onnx_training_ops.passes.dequantize_matmul_nbits import dequantize_matmul_nbits, int8_rounded
from onnx_training_ops.runtime.contrib_numerics import int8_blocks
from onnx_training_ops.runtime.session import InferenceSession

MS, NATIVE = "com.microsoft", "ai.onnx.contrib"


def _nbits(rng, n, k, bits, block, zero_points, accuracy_level, bias, weight_inputs):
    """A MatMulNBits model (the weight as initializers, or as graph inputs) and its feeds."""
    _, inits = quantized_weight(rng, n, k, bits, block, zero_points)
    if bias:
        inits["bias"] = rng.standard_normal(n).astype(np.float32)
    names = ["B", "scales", "zero_points" if "zero_points" in inits else "", "", "bias" if bias else ""]
    while not names[-1]:
        names.pop()
    node = matmul_nbits(n, k, bits, block, names, accuracy_level, a="x", out="y")
    x = (rng.standard_normal((2, 3, k)) * rng.uniform(0.1, 3.0, (2, 3, 1))).astype(np.float32)
    x[0, 0, :block] = 0.0  # an all-zero block
    if weight_inputs:
        return _model([node], {"x": x, **inits}, ["y"], {}), {"x": x, **inits}
    return _model([node], {"x": x}, ["y"], inits), {"x": x}


CASES = [  # bits, block, zero points, accuracy_level, bias, K
    (4, 32, "none", 4, True, 96), (4, 32, "uint8", 4, False, 96), (4, 16, "uint8", 4, True, 64),
    (4, 64, "none", 1, False, 128), (4, 128, "uint8", 4, False, 256), (8, 32, "uint8", 4, True, 64),
    (2, 32, "none", 4, False, 64), (4, 32, "uint8", 4, True, 72),  # the last block partial
]


@pytest.mark.parametrize("native", [False, True], ids=["standard", "native"])
@pytest.mark.parametrize("bits,block,zero_points,accuracy_level,bias,k", CASES)
def test_a_weight_read_as_an_input_computes_the_prepacked_kernels_output_by_row_ranges(
        monkeypatch, native, bits, block, zero_points, accuracy_level, bias, k):
    n = 48  # the same weight and input twice (the same seed): as initializers, as graph inputs
    deployed, feeds = _nbits(np.random.default_rng(1), n, k, bits, block, zero_points, accuracy_level, bias, False)
    as_inputs, input_feeds = _nbits(np.random.default_rng(1), n, k, bits, block, zero_points, accuracy_level,
                                    bias, True)
    want = session(deployed).run(["y"], feeds)[0]  # onnxruntime prepacks the constant weight
    monkeypatch.setattr(rules_quantized, "DEQUANTIZED_BYTES", n * k * 4 // 3)
    rewritten = dequantize_matmul_nbits(as_inputs, int8_blocks, native=native)
    ops = [node.op_type for node in rewritten.graph.node]
    assert "MatMulNBits" not in ops and ops.count("FusedMatMul") == 3 and "Concat" in ops
    assert (ops.count("TrainingDequantizeRows") == 3) == native
    run = InferenceSession(rewritten) if native else session(rewritten)
    got = run.run(["y"], input_feeds)[0]
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()  # float32 sums in another order


def test_without_the_pass_a_weight_read_as_an_input_loses_the_int8_activations():
    """onnxruntime's fallback for an unprepacked weight ignores accuracy_level: what the pass is for."""
    if not int8_blocks(4, 32):
        pytest.skip("this onnxruntime and CPU run accuracy_level=4 in float32 anyway")
    as_inputs, input_feeds = _nbits(np.random.default_rng(0), 48, 96, 4, 32, "uint8", 4, False, True)
    deployed, feeds = _nbits(np.random.default_rng(0), 48, 96, 4, 32, "uint8", 4, False, False)
    want = session(deployed).run(["y"], feeds)[0]
    fallback = session(as_inputs).run(["y"], input_feeds)[0]
    assert np.abs(fallback - want).max() > 1e-4 * np.abs(want).max()


def test_a_constant_weight_and_a_weight_with_g_idx_stay_matmul_nbits(rng):
    deployed, _ = _nbits(rng, 16, 64, 4, 32, "uint8", 4, False, weight_inputs=False)
    assert [n.op_type for n in dequantize_matmul_nbits(deployed, int8_blocks).graph.node] == ["MatMulNBits"]
    _, inits = quantized_weight(rng, 16, 64, 4, 32, "none", g_idx=True)
    node = matmul_nbits(16, 64, 4, 32, ["B", "scales", "", "g_idx"], 4, a="x", out="y")
    model = _model([node], {"x": np.zeros((2, 64), np.float32), **inits}, ["y"], {})
    assert [n.op_type for n in dequantize_matmul_nbits(model, int8_blocks).graph.node] == ["MatMulNBits"]


@pytest.mark.parametrize("bits,block,zero_points,k,rows", [
    (4, 32, "uint8", 96, (0, 48)), (4, 32, "none", 96, (5, 29)), (8, 16, "uint8", 48, (0, 7)),
    (2, 32, "uint8", 64, (40, 48)), (4, 32, "uint8", 72, (3, 30))])
def test_the_native_dequantization_gives_gather_block_quantizeds_values(rng, bits, block, zero_points, k, rows):
    n = 48
    _, inits = quantized_weight(rng, n, k, bits, block, zero_points)
    blocks = -(-k // block)
    data = inits["B"].reshape(n, -1)
    scales = inits["scales"].reshape(n, blocks)
    start, stop = rows
    feeds = {"data": data, "scales": scales}
    zp_input = []
    if "zero_points" in inits:
        feeds["zp"] = inits["zero_points"].reshape(n, -1)
        zp_input = ["zp"]
    gbq = helper.make_node("GatherBlockQuantized", ["data", "rows", "scales", *zp_input], ["w"], domain=MS,
                           bits=bits, block_size=block, gather_axis=0, quantize_axis=1)
    standard = _model([gbq], {**feeds, "rows": np.arange(start, stop, dtype=np.int64)}, ["w"], {})
    want = session(standard).run(["w"], {**feeds, "rows": np.arange(start, stop, dtype=np.int64)})[0][:, :k]
    config = np.asarray([bits, block, k, start, stop], np.int64)
    native = helper.make_node("TrainingDequantizeRows", ["data", "scales", "zp" if zp_input else "none", "config",
                                                         "scales"], ["w"], domain=NATIVE)
    inits_native = {"config": config, **({} if zp_input else {"none": np.zeros(0, np.uint8)})}
    model = _model([native], feeds, ["w"], inits_native, domains=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid(NATIVE, 1)])
    got = InferenceSession(model).run(["w"], feeds)[0]
    np.testing.assert_array_equal(got, want)


def test_the_native_dequantization_names_the_node_on_a_bad_config(rng):
    _, inits = quantized_weight(rng, 8, 64, 4, 32, "none")
    feeds = {"data": inits["B"].reshape(8, -1), "scales": inits["scales"].reshape(8, 2)}
    node = helper.make_node("TrainingDequantizeRows", ["data", "scales", "none", "config", "scales"], ["w"],
                            domain=NATIVE, name="dequant_lm_head")
    model = _model([node], feeds, ["w"], {"config": np.asarray([4, 32, 64, 4, 9], np.int64),  # stop > N
                                          "none": np.zeros(0, np.uint8)},
                   domains=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE, 1)])
    with pytest.raises(Exception, match="dequant_lm_head"):
        InferenceSession(model).run(["w"], feeds)


@pytest.mark.parametrize("shape,block", [((2, 3, 96), 32), ((5, 72), 32), ((4, 64), 16), ((1, 1, 130), 128)])
def test_the_native_int8_rounding_is_the_standard_ops(rng, shape, block):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10.0, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[0, :block] = 0.0
    x.reshape(-1, shape[-1])[-1, :3] = [2.5, -2.5, 0.5]  # ties (scaled) round half to even alike
    em = Emitter("r/", 21, {"x": ValueMeta(TensorProto.FLOAT, shape)})
    out = int8_rounded(em, "x", shape[-1], block)
    em.nodes[-1].output[0] = "y"
    del out
    standard = _model(em.nodes, {"x": x}, ["y"], {})
    want = session(standard).run(["y"], {"x": x})[0]
    native = helper.make_node("TrainingInt8Blocks", ["x", "block"], ["y"], domain=NATIVE)
    model = _model([native], {"x": x}, ["y"], {"block": np.asarray([block], np.int64)},
                   domains=[helper.make_opsetid("", 21), helper.make_opsetid(NATIVE, 1)])
    np.testing.assert_array_equal(InferenceSession(model).run(["y"], {"x": x})[0], want)
    scale = np.abs(np.pad(x.reshape(-1, shape[-1]), ((0, 0), (0, -shape[-1] % block)))
                   ).reshape(-1, (shape[-1] + block - 1) // block, block).max(-1) / 127
    assert np.all(np.abs(want - x).reshape(-1, shape[-1]).max(-1) <= scale.max(-1) / 2 * (1 + 1e-6))


# ---------------------------------------------------------------- a large model's session


genai = pytest.importorskip("genai_models")


@pytest.fixture(scope="module")
def built_int8(tmp_path_factory):
    """A tiny Llama at the builder's CPU default, accuracy_level=4 (int8 activations)."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    return genai.tiny(str(tmp_path_factory.mktemp("genai_int8")), accuracy_level=None)


def test_a_large_models_session_trains_as_the_model_whose_weights_onnxruntime_prepacks(built_int8, monkeypatch):
    from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingSession, add_lora, build_training_model

    model = build_training_model(add_lora(built_int8.onnx, rank=4, targets=["q_proj", "v_proj", "down_proj"]),
                                 CrossEntropyLoss(shift_labels=True), AdamW(lr=1e-2))
    assert any(a.name == "accuracy_level" and a.i == 4 for n in model.graph.node if n.op_type == "MatMulNBits"
               for a in n.attribute)
    ids = np.random.default_rng(0).integers(3, genai.TINY["vocab_size"], (2, 12)).astype(np.int64)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}
    small = TrainingSession(model)  # the weights in the message: onnxruntime prepacks them
    want = [float(small.step(batch)["loss"]) for _ in range(3)]
    monkeypatch.setenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", "1024")
    monkeypatch.setattr(rules_quantized, "DEQUANTIZED_BYTES", 64 * 64 * 4 // 2)  # two row ranges a weight
    from onnx_training_ops.training.graphs import binding

    rewritten = []

    def counted(graph, *args, **kwargs):
        result = dequantize_matmul_nbits(graph, *args, **kwargs)
        rewritten.append(sum(n.op_type == "FusedMatMul" for n in result.graph.node))
        return result

    monkeypatch.setattr(binding, "dequantize_matmul_nbits", counted)
    large = TrainingSession(model)  # the weights bound as inputs
    assert rewritten and rewritten[0] >= 2 * 11  # every MatMulNBits of the 2 layers and lm_head, by 2 ranges
    got = [float(large.step(batch)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=2e-6)
    # three AdamW steps of 1e-2 each: float32 rounding in the gradients moves an element by 1e-5 at most
    np.testing.assert_allclose(large.get_flat_parameters(), small.get_flat_parameters(), rtol=1e-4, atol=3e-5)
