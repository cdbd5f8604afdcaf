"""LoRA on onnxruntime-genai's int4 models (issue 38): a tiny Llama built by the genai builder in the
suite (hidden 64, 2 layers, vocabulary 256; accuracy_level=1, float32 activations), adapters trained
on its 4-bit graph, served by onnxruntime-genai's multi-LoRA, loaded by peft onto the Hugging Face
model with the dequantized weights, and torch + peft's trajectory over 10 AdamW steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import numpy_helper

from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingOpError, TrainingSession, add_lora, build_training_model
from onnx_training_ops.lora import lora_spec
from onnx_training_ops.lora.formats import PEFT_CONFIG, read_adapter, save_adapter, write_serving_model

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
og = pytest.importorskip("onnxruntime_genai")

import genai_models as genai  # noqa: E402 - after the skips: it builds with torch and transformers

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = genai.TINY["vocab_size"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return genai.tiny(str(tmp_path_factory.mktemp("genai")))


def _batch(seed: int, batch: int = 2, seq: int = 12):
    ids = np.random.default_rng(seed).integers(3, VOCAB, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}


def _session(model, **adamw) -> TrainingSession:
    return TrainingSession(build_training_model(model, CrossEntropyLoss(shift_labels=True),
                                                AdamW(**{"lr": 1e-2, **adamw})))


def _peft_model(built, spec, values=None):
    """torch + peft on the dequantized weights, the adapters set to ``values`` (the model's names)."""
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0,
                             target_modules=sorted({a.module.rpartition(".")[2] for a in spec.adapters}))
    model = peft.get_peft_model(genai.dequantized_hf_model(built), config)
    if values is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for a in spec.adapters:
                params[f"base_model.model.{a.module}.lora_A.default.weight"].copy_(torch.from_numpy(values[a.a].T))
                params[f"base_model.model.{a.module}.lora_B.default.weight"].copy_(torch.from_numpy(values[a.b].T))
    return model


def _torch_logits(model, ids):
    ids = torch.from_numpy(ids)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()


def _ort_logits(model, ids):
    """The model's logits in onnxruntime, the key/value cache empty."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString())
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            head = genai.TINY["hidden_size"] // genai.TINY["num_attention_heads"]
            feeds[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, head), np.float32)
    return session.run(["logits"], feeds)[0]


def test_a_genai_folder_trains_only_its_adapters_without_the_key_value_cache(built):
    model = add_lora(built.onnx, rank=4, alpha=8, targets=ALL)
    spec = lora_spec(model)
    assert spec.model_type == "llama" and spec.source == built.onnx
    assert [(a.module, a.start, a.stop) for a in spec.adapters[:4]] == [
        ("model.layers.0.self_attn.q_proj", 0, 64), ("model.layers.0.self_attn.k_proj", 64, 96),
        ("model.layers.0.self_attn.v_proj", 96, 128), ("model.layers.0.self_attn.o_proj", 0, 64)]
    session = _session(model)
    assert sorted(session.feed_names) == ["attention_mask", "input_ids", "labels"]  # no past_key_values.*
    assert session.metadata["trainable"].split(",") == spec.trainable
    losses = [float(session.step(_batch(0))["loss"]) for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3
    with pytest.raises(TrainingOpError, match="MatMulNBits.*adapter"):
        build_training_model(built.onnx, CrossEntropyLoss(shift_labels=True), AdamW(),
                             trainable=["model.layers.0.attn.qkv_proj.MatMul.weight_scales"])


@pytest.fixture(scope="module")
def trained(built):
    session = _session(add_lora(built.onnx, rank=4, alpha=8, targets=ALL))
    for i in range(5):
        session.step(_batch(i))
    return session


def test_the_served_adapter_gives_the_sessions_logits_in_onnxruntime_genai(built, trained, tmp_path):
    served = tmp_path / "served"
    trained.save_adapter(served / "tuned.onnx_adapter", format="onnxruntime", base_model=served)
    model = og.Model(str(served))
    adapters = og.Adapters(model)
    adapters.load(str(served / "tuned.onnx_adapter"), "tuned")
    prompt = _batch(11, batch=1, seq=7)["input_ids"]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16, do_sample=False)
    generator = og.Generator(model, params)
    generator.set_active_adapter(adapters, "tuned")
    generator.append_tokens(prompt)
    ids = prompt
    for _ in range(3):  # the prompt, then two tokens through the key/value cache
        want = trained.evaluate({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids},
                                outputs=["logits"])["logits"][0, -1]
        np.testing.assert_allclose(generator.get_logits()[0, -1], want, atol=1e-4, rtol=0)
        generator.generate_next_token()
        ids = np.concatenate([ids, generator.get_next_tokens()[None, :].astype(np.int64)], axis=1)
    plain = og.Generator(model, params)  # no adapter active: the base model
    plain.append_tokens(prompt)
    base = add_lora(built.onnx, rank=4, alpha=8, targets=ALL)  # B = 0: the base model's logits
    want = _session(base).evaluate({"input_ids": prompt, "attention_mask": np.ones_like(prompt), "labels": prompt},
                                   outputs=["logits"])["logits"][0, -1]
    np.testing.assert_allclose(plain.get_logits()[0, -1], want, atol=1e-4, rtol=0)


def test_the_peft_folder_gives_torch_on_the_dequantized_weights_the_sessions_logits(built, trained, tmp_path):
    folder = trained.save_adapter(tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    assert config["target_modules"] == sorted(ALL) and config["rank_pattern"] == {}
    tuned = peft.PeftModel.from_pretrained(genai.dequantized_hf_model(built), folder).eval()
    feeds = _batch(21)
    got = trained.evaluate(feeds, outputs=["logits"])["logits"]
    np.testing.assert_allclose(_torch_logits(tuned, feeds["input_ids"]), got, atol=1e-4, rtol=0)


def test_losses_and_adapter_gradients_follow_torch_and_peft_over_10_adamw_steps(built):
    """accuracy_level=1 (float32 activations): the ONNX forward is torch's on the dequantized
    weights. B starts non-zero (at peft's zeros every A gradient is 0 and eps=0 divides 0 by 0);
    eps=0: ONNX's Adam puts epsilon before the bias correction, torch after."""
    model = add_lora(built.onnx, rank=4, alpha=8, targets=ALL)
    spec = lora_spec(model)
    rng = np.random.default_rng(5)
    values = {}
    for init in model.graph.initializer:
        if init.name in spec.trainable:
            value = numpy_helper.to_array(init).copy()
            if init.name.endswith("lora_B.weight"):
                value = (0.05 * rng.standard_normal(value.shape)).astype(np.float32)
            values[init.name] = value
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    session = _session(model, lr=1e-3, betas=(0.9, 0.999), eps=0.0, weight_decay=0.01)
    reference = _peft_model(built, spec, values).train()
    params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3, betas=(0.9, 0.999), eps=0.0, weight_decay=0.01)
    torch_names = {a.a: f"base_model.model.{a.module}.lora_A.default.weight" for a in spec.adapters}
    torch_names.update({a.b: f"base_model.model.{a.module}.lora_B.default.weight" for a in spec.adapters})
    for step in range(10):
        feeds = _batch(100 + step)
        loss = float(session.backward(feeds)["loss"])
        grads = session.gradients()
        session.optimizer_step()
        optimizer.zero_grad()
        out = reference(input_ids=torch.from_numpy(feeds["input_ids"]),
                        attention_mask=torch.from_numpy(feeds["attention_mask"]),
                        labels=torch.from_numpy(feeds["labels"]))
        out.loss.backward()
        optimizer.step()
        assert abs(loss - out.loss.item()) < 1e-5, (step, loss, out.loss.item())
        for name, grad in grads.items():
            np.testing.assert_allclose(grad.T, params[torch_names[name]].grad.numpy(), atol=1e-4, rtol=0,
                                       err_msg=f"step {step} {name}")


def test_phi3_fused_modules_go_to_peft_as_one_adapter_each_and_back(tmp_path_factory, tmp_path):
    """Phi-3's Hugging Face model fuses q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``); the
    builder keeps qkv fused and splits gate/up. The ONNX model's per-slice adapters go to peft as
    one adapter per fused module (stacked A, block-diagonal B, rank and alpha times the parts):
    torch + peft on the dequantized weights computes the ONNX model's logits. (Intermediate size
    96: the builder takes any Linear as wide as the vocabulary for lm_head, so 2 x 128 would not do.)"""
    phi = genai.tiny(str(tmp_path_factory.mktemp("phi3")), config={"intermediate_size": 96}, architecture="phi3")
    model = add_lora(phi.onnx, rank=2, alpha=4, targets="all-linear")
    spec = lora_spec(model)
    assert spec.model_type == "phi3"
    assert {a.module.rpartition(".")[2] for a in spec.adapters} == set(ALL)
    values = _random_adapters(model, spec, seed=0)
    folder = save_adapter(spec, values, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert config["rank_pattern"]["model.layers.0.self_attn.qkv_proj"] == 6
    assert config["alpha_pattern"]["model.layers.0.mlp.gate_up_proj"] == 8
    ids = _batch(3)["input_ids"]
    want = _ort_logits(model, ids)
    tuned = peft.PeftModel.from_pretrained(genai.dequantized_hf_model(phi), folder).eval()
    np.testing.assert_allclose(_torch_logits(tuned, ids), want, atol=1e-4, rtol=0)
    with tuned.disable_adapter():
        assert np.abs(want - _torch_logits(tuned, ids)).max() > 1e-2  # the adapters do something
    back = read_adapter(spec, folder)
    for name in spec.trainable:
        np.testing.assert_allclose(back[name], values[name], rtol=1e-6, atol=1e-7)


def _random_adapters(model, spec, seed: int) -> dict[str, np.ndarray]:
    """Random (non-zero) values for every adapter tensor of ``model``, written into it and returned."""
    rng = np.random.default_rng(seed)
    values = {}
    for init in model.graph.initializer:
        if init.name in spec.trainable:
            values[init.name] = (0.2 * rng.standard_normal(tuple(init.dims))).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return values


def test_a_fused_gate_up_proj_gets_an_adapter_per_half_as_peft_has_on_gate_proj_and_up_proj(tmp_path_factory,
                                                                                          tmp_path):
    fused = genai.tiny(str(tmp_path_factory.mktemp("gate_up")), fuse_mlp_gate_up="true")
    model = add_lora(fused.onnx, rank=2, alpha=4, targets=["gate_proj", "up_proj"])
    spec = lora_spec(model)
    width = genai.TINY["intermediate_size"]
    assert [(a.module, a.start, a.stop) for a in spec.adapters[:2]] == [
        ("model.layers.0.mlp.gate_proj", 0, width), ("model.layers.0.mlp.up_proj", width, 2 * width)]
    values = _random_adapters(model, spec, seed=1)
    folder = save_adapter(spec, values, tmp_path / "peft")
    ids = _batch(4)["input_ids"]
    tuned = peft.PeftModel.from_pretrained(genai.dequantized_hf_model(fused), folder).eval()
    np.testing.assert_allclose(_torch_logits(tuned, ids), _ort_logits(model, ids), atol=1e-4, rtol=0)


def test_an_adapter_for_another_base_and_a_base_without_its_source_are_refused(built, trained, tmp_path_factory,
                                                                              tmp_path):
    other = genai.tiny(str(tmp_path_factory.mktemp("wider")), config={"hidden_size": 96, "num_attention_heads": 6,
                                                                     "num_key_value_heads": 3})
    trained.save_adapter(tmp_path / "peft")
    trained.save_adapter(tmp_path / "a.onnx_adapter", format="onnxruntime")
    wider = _session(add_lora(other.onnx, rank=4, alpha=8, targets=ALL))
    for path in (tmp_path / "peft", tmp_path / "a.onnx_adapter"):
        with pytest.raises(TrainingOpError, match="another base model"):
            wider.load_adapter(path)
    from onnx_training_ops.storage import load_model

    in_memory = lora_spec(add_lora(load_model(built.onnx), targets=["q_proj"]))
    with pytest.raises(TrainingOpError, match="given a model in memory"):
        write_serving_model(in_memory, tmp_path / "served")
    with pytest.raises(TrainingOpError, match="not the base model the adapters were added to"):
        write_serving_model(lora_spec(add_lora(built.onnx, targets=["q_proj"])), tmp_path / "served2",
                            source=other.onnx)
