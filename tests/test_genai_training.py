"""Training through the graphs onnxruntime-genai's model builder deploys (issue 38 item 1): for
Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma and Gemma 2 built at int4 (fp32 activations,
``accuracy_level=1``), and three of them at fp32, the causal-LM loss and the gradients of every float parameter of
the ONNX graph equal torch's on the Hugging Face model in float64 whose linear weights are the
ONNX graph's (the dequantized int4 weights), with the KV-cache outputs ignored and empty pasts fed.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from genai_models import FAMILIES, dequantized, genai_model, hf_folder, torch_model

import onnx_training_ops as ot

pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) builds the models")
torch = pytest.importorskip("torch")

B, S = 2, 10


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("genai")


def _batch(family: str):
    """input_ids, attention_mask (row 1 right-padded, except for Gemma 2's windowed layer, which
    onnxruntime runs on unpadded prompts only), labels = input_ids with -100 at the padding."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, (B, S)).astype(np.int64)
    mask = np.ones((B, S), np.int64)
    if family != "gemma2":
        mask[1, 7:] = 0
    return ids, mask, np.where(mask == 1, ids, -100)


def _feeds(model: onnx.ModelProto, folder, ids, mask, labels) -> dict:
    """The batch, and the pasts ``model`` still takes (the builder removes those that only fill an
    attention node's cache, :mod:`onnx_training_ops.builder.kv_cache`): empty pasts
    ``[B, kv_heads, 0, head_size]``, or for a layer genai_config.json lists under ``sliding_window``
    a zero cache of the window's capacity (onnxruntime refuses a smaller one)."""
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    windowed = config.get("sliding_window") or {}
    feeds = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for vi in model.graph.input:
        if vi.name.startswith("past_key_values."):
            layer = int(vi.name.split(".")[1])
            length = windowed["window_size"] if layer in windowed.get("layers", ()) else 0
            feeds[vi.name] = np.zeros((B, config["num_key_value_heads"], length, config["head_size"]), np.float32)
    return feeds


# ONNX initializer (genai's name, layer i) -> Hugging Face parameter(s), laid out as the ONNX one
def _hf_layout(name: str, params: dict, family: str):
    """The Hugging Face tensor(s) behind the ONNX initializer ``name``, in its layout (MatMul
    weights [in, out], fused q/k/v, Phi-3's fused gate/up split), or None."""
    if name in params:
        return params[name]
    parts = name.split(".")
    if name == "lm_head.MatMul.weight":
        return (params.get("lm_head.weight", params["model.embed_tokens.weight"])).T
    if "final_norm_layernorm" in name:
        return params["model.norm.weight"]
    if len(parts) < 4 or parts[1] != "layers":
        return None
    layer = f"model.layers.{parts[2]}"
    module, proj = parts[3], parts[4]
    if module == "attn" and proj == "qkv_proj":
        if family == "phi3":
            fused = params[f"{layer}.self_attn.qkv_proj.{parts[-1]}"]
        else:
            fused = torch.cat([params[f"{layer}.self_attn.{p}_proj.{parts[-1]}"] for p in "qkv"], 0)
        return fused.T if parts[-1] == "weight" else fused
    if module == "attn" and proj in ("q_norm", "k_norm"):
        return params[f"{layer}.self_attn.{proj}.weight"]
    if module == "attn":
        return params[f"{layer}.self_attn.{proj}.weight"].T
    if module == "mlp" and family == "phi3" and proj in ("gate_proj", "up_proj"):
        gate, up = params[f"{layer}.mlp.gate_up_proj.weight"].chunk(2, 0)
        return (gate if proj == "gate_proj" else up).T
    if module == "mlp":
        return params[f"{layer}.mlp.{proj}.weight"].T
    return None


def _set_dequantized(hf, model: onnx.ModelProto, family: str) -> None:
    """Load the ONNX graph's dequantized MatMulNBits weights (and a GatherBlockQuantized
    embedding's) into the Hugging Face model."""
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for node_name, w in dequantized(model).items():
            parts = node_name.strip("/").split("/")  # model/layers.0/attn/qkv_proj/MatMul_Q4 | lm_head/MatMul_Q4
            w = torch.tensor(w)
            if parts[0] == "lm_head":
                params.get("lm_head.weight", params["model.embed_tokens.weight"]).copy_(w)
                continue
            layer, module, proj = f"model.{parts[1]}", parts[2], parts[3]
            if module == "attn" and proj == "qkv_proj":
                if family == "phi3":
                    params[f"{layer}.self_attn.qkv_proj.weight"].copy_(w)
                    continue
                q, kv = hf.config.num_attention_heads, hf.config.num_key_value_heads
                head = w.shape[0] // (q + 2 * kv)
                for p, chunk in zip("qkv", w.split([q * head, kv * head, kv * head], 0)):
                    params[f"{layer}.self_attn.{p}_proj.weight"].copy_(chunk)
            elif module == "attn":
                params[f"{layer}.self_attn.{proj}.weight"].copy_(w)
            elif family == "phi3" and proj in ("gate_proj", "up_proj"):
                gate, up = params[f"{layer}.mlp.gate_up_proj.weight"].chunk(2, 0)
                (gate if proj == "gate_proj" else up).copy_(w)
            else:
                params[f"{layer}.mlp.{proj}.weight"].copy_(w)


def _torch_loss_and_grads(hf, ids, mask, labels):
    hf.zero_grad()
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}


DEPLOYED = [(family, "int4") for family in FAMILIES] + [  # fp32: the same contrib ops, MatMul weights
    ("llama", "fp32"), ("qwen3", "fp32"), ("gemma2", "fp32")]  # gemma2: the tied embedding (Transpose, Gather)


@pytest.mark.parametrize("family,precision", DEPLOYED)
def test_gradients_match_torch_on_the_deployed_graph(root, family, precision):
    """The loss and every float parameter's gradient (int4: the norms, biases, fp32 embedding;
    fp32: every weight) of the builder's graph, trained as deployed, against torch + transformers
    on the same weights in float64."""
    options = {"accuracy_level": 1} if precision == "int4" else {}
    folder = genai_model(family, precision, root, **options)
    model = onnx.load(folder / "model.onnx")
    hf = torch_model(hf_folder(root / family / "hf", family))
    if precision == "int4":
        _set_dequantized(hf, model, family)
    ids, mask, labels = _batch(family)
    want_loss, want_grads = _torch_loss_and_grads(hf, ids, mask, labels)

    trained = ot.build_training_model(model, ot.CrossEntropyLoss(shift_labels=True), ot.AdamW(), output="logits")
    session = ot.TrainingSession(trained)
    loss = float(session.backward(_feeds(trained, folder, ids, mask, labels))["loss"])
    assert abs(loss - want_loss) < 1e-6 * abs(want_loss)
    grads = session.gradients()
    assert grads and not {"cos_cache", "sin_cache"} & set(grads), sorted(grads)  # rotary tables never train
    torch_grads = {n: want_grads.get(n, torch.zeros_like(p)) for n, p in hf.named_parameters()}
    for name, got in grads.items():
        want = _hf_layout(name, torch_grads, family)
        assert want is not None, f"{name} has no Hugging Face counterpart"
        want = want.detach().numpy()
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, (name, err)


def _session_gradients(folder, family):
    trained = ot.build_training_model(onnx.load(folder / "model.onnx"), ot.CrossEntropyLoss(shift_labels=True),
                                      ot.AdamW(lr=1e-2), output="logits")
    session = ot.TrainingSession(trained)
    feeds = _feeds(trained, folder, *_batch(family))
    return session, feeds, float(session.backward(feeds)["loss"]), session.gradients()


def test_the_builders_default_int4_trains_with_a_straight_through_gradient(root):
    """The CPU default, accuracy_level=4, quantizes each MatMulNBits input to int8 inside the
    kernel: the forward keeps that, the gradient treats it as the identity (straight-through),
    so it is close to, not equal to, the fp32-activation model's; and the model trains."""
    default = genai_model("llama", "int4", root)
    levels = {a.i for n in onnx.load(default / "model.onnx", load_external_data=False).graph.node
              if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}
    session, feeds, loss, grads = _session_gradients(default, "llama")
    _, _, loss1, grads1 = _session_gradients(genai_model("llama", "int4", root, accuracy_level=1), "llama")
    assert 0 < abs(loss - loss1) < 1e-2 * loss1
    for name, g in grads.items():
        assert 0 < np.abs(g - grads1[name]).max() < 0.1 * np.abs(grads1[name]).max(), name
    session.zero_grad()
    losses = [float(session.step(feeds)["loss"]) for _ in range(4)]
    assert losses[-1] < losses[0]
