"""docs/gpu.md's GPU examples, run as written on the CPU: the same code with ``device="cpu"`` (or the CPU
provider), on the files and batches the page assumes (a tiny GPT-2 exported as the recipes do, an MLP).
tests/test_gpu.py runs the engine on CUDA where a GPU is present."""

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- not-run: (?P<reason>.*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _block(containing: str) -> str:
    blocks = [m["code"] for m in BLOCK.finditer((ROOT / "docs" / "gpu.md").read_text()) if containing in m["code"]]
    assert len(blocks) == 1, f"docs/gpu.md: expected one python block with {containing!r}"
    return textwrap.dedent(blocks[0])


def _on_the_cpu(code: str, gpu: str, cpu: str) -> str:
    assert gpu in code, f"the example no longer says {gpu}"
    return code.replace(gpu, cpu)


@pytest.mark.filterwarnings("ignore:.*the TorchScript exporter had merged")
def test_the_gpt2_example_runs_on_the_cpu(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from onnx_training_ops.export.from_torch import export_for_training

    class Wrapped(torch.nn.Module):  # as docs/recipes.md exports GPT-2
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, use_cache=False)
    module = Wrapped(transformers.GPT2LMHeadModel(config).eval())
    ids = torch.randint(0, 50, (2, 16))
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        batch_ids = rng.integers(0, 50, (8, 256))
        batches.append({"input_ids": batch_ids, "attention_mask": np.ones_like(batch_ids), "labels": batch_ids})
    with torch.no_grad():  # before the export: a TorchScript export leaves the module's outputs changed
        want = float(module.model(input_ids=torch.from_numpy(batches[0]["input_ids"]),
                                  labels=torch.from_numpy(batches[0]["labels"])).loss)
    monkeypatch.chdir(tmp_path)
    export_for_training(module, (ids, torch.ones_like(ids)), "gpt2.onnx", input_names=["input_ids", "attention_mask"],
                        output_names=["logits"], dynamo=False,
                        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}})
    namespace = {"batches": batches}
    exec(_on_the_cpu(_block("gpt2.onnx"), 'device="cuda"', 'device="cpu"'), namespace)
    session = namespace["session"]
    assert session.device == "cpu" and np.isfinite(float(namespace["loss"]))
    assert (tmp_path / "out" / "checkpoint.onnx").is_file()
    # the loss the example builds is transformers' causal-LM loss
    from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingSession, build_training_model

    fresh = TrainingSession(build_training_model("gpt2.onnx", CrossEntropyLoss(shift_labels=True), AdamW(lr=1e-4)))
    assert float(fresh.evaluate(batches[0])["loss"]) == pytest.approx(want, rel=1e-5)


def test_the_device_trainer_example_runs_on_the_cpu(tmp_path, monkeypatch):
    from onnx_training_ops import AdamW, build_training_model
    from onnx_training_ops.demo import make_mlp

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    batch = lambda: {"input": rng.standard_normal((16, 8)).astype(np.float32), "labels": rng.integers(0, 4, 16)}
    namespace = {"training_model": build_training_model(make_mlp((8, 16, 4)), "cross_entropy", AdamW(lr=1e-2)),
                 "batches": [batch() for _ in range(3)], "eval_batch": batch()}
    code = _on_the_cpu(_block("DeviceTrainer("), 'providers=["CUDAExecutionProvider", "CPUExecutionProvider"]',
                       'providers=["CPUExecutionProvider"]')
    exec(code, namespace)
    assert np.isfinite(float(namespace["loss"])) and (tmp_path / "out" / "state.safetensors").is_file()
