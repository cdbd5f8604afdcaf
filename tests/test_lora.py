"""add_lora on standard-op models (torch.onnx.export of a transformers Llama, Gemm layers): the
adapters' math, training only them, peft folders and onnxruntime adapter files out and back, and
the errors. onnxruntime-genai's int4 models: tests/test_lora_genai.py."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingOpError, TrainingSession, add_lora, build_training_model
from onnx_training_ops.lora import lora_spec
from onnx_training_ops.lora.formats import PEFT_CONFIG, PEFT_WEIGHTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))
    return model


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask).logits


def _export(model, path: str, exporter: str) -> str:
    ids = torch.randint(0, VOCAB, (2, 8))
    args = (ids, torch.ones_like(ids))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(_Logits(model), args, path, dynamo=False, input_names=["input_ids", "attention_mask"],
                              output_names=["logits"], dynamic_axes={"input_ids": {0: "b", 1: "s"},
                                                                     "attention_mask": {0: "b", 1: "s"}})
        else:
            torch.onnx.export(_Logits(model), args, path, input_names=["input_ids", "attention_mask"],
                              output_names=["logits"], optimize=False,
                              dynamic_shapes=({0: "b", 1: "s"}, {0: "b", 1: "s"}))
    return path


def _batch(seed: int = 0, batch: int = 2, seq: int = 8):
    ids = np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}


def _session(model, lr: float = 1e-2) -> TrainingSession:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's merged initializers: untied, said
        training = build_training_model(model, CrossEntropyLoss(shift_labels=True), AdamW(lr=lr))
    return TrainingSession(training)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {e: _export(_llama(), str(root / f"{e}.onnx"), e) for e in ("torchscript", "dynamo")}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_peft_folder_loads_onto_the_hugging_face_model_with_the_sessions_logits(exported, exporter, tmp_path):
    model = add_lora(exported[exporter], rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    spec = lora_spec(model)
    assert [a.module for a in spec.adapters][:3] == ["model.layers.0.self_attn.q_proj",
                                                    "model.layers.0.self_attn.v_proj",
                                                    "model.layers.0.mlp.down_proj"]
    session = _session(model)
    assert session.metadata["trainable"].split(",") == spec.trainable  # only the adapters train
    losses = [float(session.step(_batch(0))["loss"]) for _ in range(4)]
    assert losses[-1] < losses[0]
    folder = session.save_adapter(tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["down_proj", "q_proj",
                                                                                           "v_proj"]
    tuned = peft.PeftModel.from_pretrained(_llama(), folder).eval()
    feeds = _batch(9)
    with torch.no_grad():
        want = tuned(input_ids=torch.from_numpy(feeds["input_ids"]),
                     attention_mask=torch.from_numpy(feeds["attention_mask"])).logits.numpy()
    got = session.evaluate(feeds, outputs=["logits"])["logits"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    base = _llama()(input_ids=torch.from_numpy(feeds["input_ids"])).logits.detach().numpy()
    assert np.abs(want - base).max() > 1e-3  # the adapters changed the model


def test_adapters_come_back_from_both_formats_and_a_foreign_one_is_refused(exported, tmp_path):
    session = _session(add_lora(exported["torchscript"], rank=4, alpha=16, targets=["q_proj", "v_proj"]))
    for i in range(3):
        session.step(_batch(i))
    names = lora_spec(session.training_model()).trainable
    trained = dict(zip(names, (v.copy() for v in session.state_views(names))))
    session.save_adapter(tmp_path / "peft")
    session.save_adapter(tmp_path / "a.onnx_adapter", format="onnxruntime")
    for path in (tmp_path / "peft", tmp_path / "a.onnx_adapter"):
        fresh = _session(add_lora(exported["torchscript"], rank=4, alpha=16, targets=["q_proj", "v_proj"]))
        fresh.load_adapter(path)
        for name, value in zip(names, fresh.state_views(names)):
            np.testing.assert_allclose(value, trained[name], rtol=1e-6, atol=1e-7)
    other_targets = _session(add_lora(exported["torchscript"], rank=4, alpha=16, targets=["q_proj", "k_proj"]))
    for path in (tmp_path / "peft", tmp_path / "a.onnx_adapter"):
        with pytest.raises(TrainingOpError, match="another base model or other targets"):
            other_targets.load_adapter(path)
    other_rank = _session(add_lora(exported["torchscript"], rank=8, alpha=16, targets=["q_proj", "v_proj"]))
    for path in (tmp_path / "peft", tmp_path / "a.onnx_adapter"):
        with pytest.raises(TrainingOpError, match="another rank"):
            other_rank.load_adapter(path)


def test_a_peft_adapter_with_another_alpha_loads_as_the_same_function(exported, tmp_path):
    source = _session(add_lora(exported["torchscript"], rank=4, alpha=4, targets=["v_proj"]))
    source.step(_batch(0))
    source.step(_batch(1))
    source.save_adapter(tmp_path / "peft")
    target = _session(add_lora(exported["torchscript"], rank=4, alpha=32, targets=["v_proj"]))
    target.load_adapter(tmp_path / "peft")
    feeds = _batch(5)
    np.testing.assert_allclose(target.evaluate(feeds, outputs=["logits"])["logits"],
                               source.evaluate(feeds, outputs=["logits"])["logits"], atol=1e-5)


def test_targets_match_as_peft_does_and_a_target_matching_nothing_is_named(exported):
    every = lora_spec(add_lora(exported["dynamo"], targets="all-linear"))
    assert len(every.adapters) == 2 * 7 and not any(a.module == "lm_head" for a in every.adapters)
    one_layer = lora_spec(add_lora(exported["dynamo"], targets=r"model\.layers\.1\..*_proj"))
    assert {a.module.split(".")[2] for a in one_layer.adapters} == {"1"} and len(one_layer.adapters) == 7
    head = lora_spec(add_lora(exported["torchscript"], targets=["lm_head"]))
    assert [(a.module, a.in_features, a.out_features) for a in head.adapters] == [("lm_head", 32, VOCAB)]
    with pytest.raises(TrainingOpError, match=r"'q_prj' matches no linear module.*q_proj"):
        add_lora(exported["torchscript"], targets=["q_proj", "q_prj"])
    with pytest.raises(TrainingOpError, match="matches no linear module"):
        add_lora(exported["torchscript"], targets=r"encoder\..*")
    with pytest.raises(TrainingOpError, match="already has LoRA adapters"):
        add_lora(add_lora(exported["torchscript"]))
    with pytest.raises(TrainingOpError, match="rank must be a positive integer"):
        add_lora(exported["torchscript"], rank=0)


def _gemm_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((12, 6)).astype(np.float32), "fc1.weight")  # transB=1
    b1 = numpy_helper.from_array(rng.standard_normal(12).astype(np.float32), "fc1.bias")
    w2 = numpy_helper.from_array(rng.standard_normal((12, 3)).astype(np.float32), "fc2.weight")
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="/fc1/Gemm", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="/act/Relu"),
             helper.make_node("MatMul", ["r", "fc2.weight"], ["y"], name="/fc2/MatMul")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [w1, b1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_the_adapter_adds_scaling_times_x_a_b_beside_gemm_and_matmul():
    base = _gemm_model()
    model = add_lora(base, rank=2, alpha=3, targets=["fc1", "fc2"])
    spec = lora_spec(model)
    assert [(a.module, a.in_features, a.out_features) for a in spec.adapters] == [("fc1", 6, 12), ("fc2", 12, 3)]
    rng = np.random.default_rng(1)
    values = {}
    for init in model.graph.initializer:
        if "lora_" in init.name:
            values[init.name] = rng.standard_normal(tuple(init.dims)).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    x = rng.standard_normal((5, 6)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    w = {t.name: numpy_helper.to_array(t) for t in base.graph.initializer}
    a1, b1, a2, b2 = (values[f"{m}.lora_{p}.weight"] for m in ("fc1", "fc2") for p in "AB")
    h = x @ w["fc1.weight"].T + w["fc1.bias"] + 1.5 * (x @ a1) @ b1
    want = np.maximum(h, 0) @ w["fc2.weight"] + 1.5 * (np.maximum(h, 0) @ a2) @ b2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_fresh_adapter_starts_as_peft_does_and_leaves_the_output_unchanged():
    base = _gemm_model()
    model = add_lora(base, rank=4, targets=["fc1"], seed=3)
    a = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "fc1.lora_A.weight")
    b = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "fc1.lora_B.weight")
    assert a.shape == (6, 4) and b.shape == (4, 12) and not b.any()
    assert np.abs(a).max() <= 1 / np.sqrt(6) and np.abs(a).max() > 0.5 / np.sqrt(6)  # Kaiming-uniform, fan_in 6
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    run = [ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0] for m in (base, model)]
    np.testing.assert_array_equal(run[0], run[1])


def test_dropout_drops_in_train_mode_only():
    model = add_lora(_gemm_model(), rank=2, targets=["fc1"], dropout=0.5)
    assert sum(n.op_type == "Dropout" for n in model.graph.node) == 1
    for init in model.graph.initializer:
        if init.name == "fc1.lora_B.weight":
            init.CopyFrom(numpy_helper.from_array(np.ones((2, 12), np.float32), init.name))
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    feeds = {"x": x, "target": np.zeros((8, 3), np.float32)}
    losses = {}
    for mode in ("eval", "train"):
        session = TrainingSession(build_training_model(model, "mse", AdamW(lr=0.0), mode=mode))
        losses[mode] = [float(session.step(feeds)["loss"]) for _ in range(3)]
    assert losses["eval"][0] == losses["eval"][1] == losses["eval"][2]  # lr 0: nothing changes, no dropout
    assert len(set(losses["train"])) == 3  # a fresh mask each step


def _quantized_model() -> onnx.ModelProto:
    """A MatMulNBits (4-bit, K=32, N=8, block 32) and a float Mul."""
    rng = np.random.default_rng(0)
    b = numpy_helper.from_array(rng.integers(0, 255, (8, 1, 16)).astype(np.uint8), "w.q4")
    scales = numpy_helper.from_array(rng.uniform(0.01, 0.1, 8).astype(np.float32), "w.scales")
    gain = numpy_helper.from_array(np.ones(8, np.float32), "gain")
    nodes = [helper.make_node("MatMulNBits", ["x", "w.q4", "w.scales"], ["h"], name="/proj/MatMul_Q4",
                              domain="com.microsoft", K=32, N=8, bits=4, block_size=32, accuracy_level=1),
             helper.make_node("Mul", ["h", "gain"], ["y"], name="/gain/Mul")]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], [b, scales, gain])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def test_a_quantized_weight_marked_trainable_is_refused():
    with pytest.raises(TrainingOpError, match=r"'w.scales' is input 2 of .*MatMulNBits.*/proj/MatMul_Q4.*never "
                                              r"trains.*adapter"):
        build_training_model(_quantized_model(), "mse", AdamW(), trainable=["w.scales", "gain"])


def test_save_adapter_needs_adapters_and_a_known_format(tmp_path):
    session = TrainingSession(build_training_model(_gemm_model(), "mse", AdamW()))
    with pytest.raises(TrainingOpError, match="no LoRA adapters.*add_lora"):
        session.save_adapter(tmp_path / "x")
    session = TrainingSession(build_training_model(add_lora(_gemm_model(), targets=["fc2"]), "mse", AdamW()))
    with pytest.raises(TrainingOpError, match="format must be one of 'peft', 'onnxruntime'"):
        session.save_adapter(tmp_path / "x", format="gguf")
    with pytest.raises(TrainingOpError, match="no adapter at"):
        session.load_adapter(tmp_path / "missing")
    path = session.save_adapter(tmp_path / "peft")
    assert sorted(os.listdir(path)) == sorted([PEFT_CONFIG, PEFT_WEIGHTS])


def test_a_folder_is_read_as_the_model_its_genai_config_names_or_its_only_onnx_file(tmp_path):
    from onnx_training_ops.storage import load_model

    model = _gemm_model()
    (tmp_path / "one").mkdir()
    onnx.save(model, tmp_path / "one" / "mlp.onnx")
    assert load_model(tmp_path / "one").graph.name == "mlp"
    (tmp_path / "genai").mkdir()
    onnx.save(model, tmp_path / "genai" / "decoder.onnx")
    onnx.save(_quantized_model(), tmp_path / "genai" / "other.onnx")
    config = {"model": {"decoder": {"filename": "decoder.onnx"}}}
    (tmp_path / "genai" / "genai_config.json").write_text(json.dumps(config))
    assert load_model(tmp_path / "genai").graph.name == "mlp"
    (tmp_path / "genai" / "genai_config.json").unlink()
    with pytest.raises(TrainingOpError, match=r"has 2 \.onnx files: decoder\.onnx, other\.onnx and no genai_config"):
        load_model(tmp_path / "genai")
    with pytest.raises(TrainingOpError, match="has no .onnx files"):
        load_model(tmp_path)
