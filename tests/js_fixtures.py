"""Fixtures for the JavaScript trainer's tests (``js/test/``), written by Python.

For each test model: ``export_step`` of a fresh TrainingSession (``<model>/export/``), the
batches it trains on (``batches.safetensors``: each input stacked over a cycle of distinct
batches), and what Python's TrainingSession did with them (``expected.json``: the loss and
learning rates of every step; ``expected_state.safetensors``: the state after the last
step), and what the export's step model does with them in Python's onnxruntime
(``export_state.safetensors``). The Node and browser tests train the export on the same
batches and compare.

Models: the digits-sized MLP 64-128-10 (Adam); a tiny BERT classifier (transformers, 2
layers, AdamW with weight decay, clipping by global norm, warm-up + cosine schedule); a small
CNN with BatchNorm in train mode (running statistics are state) and Nesterov momentum, with
a StepLR schedule; a tiny GPT-2 causal LM (transformers, 2 layers) on right-padded batches: the
attention mask zeroes the padding and its labels are -100 (the shifted labels pass Slice/Pad,
the integer ops the WebGPU step must keep off the CPU). Also ``example/``: the browser
example's digits MLP, pre-trained in Python.

Run ``python tests/js_fixtures.py OUT_DIR`` to write them by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx_training_ops as ot  # noqa: E402
from onnx_training_ops import schedules  # noqa: E402
from onnx_training_ops.demo import make_mlp  # noqa: E402
from onnx_training_ops.export import export_step, session_from_export  # noqa: E402
from onnx_training_ops.storage import safetensors

STEPS = 200
CYCLE = 8


def _mlp(rng):
    training = ot.build_training_model(make_mlp((64, 128, 10)), "cross_entropy", ot.Adam(lr=1e-3))
    teacher = rng.standard_normal((64, 10)).astype(np.float32)
    x = rng.standard_normal((CYCLE, 32, 64)).astype(np.float32)
    return training, {"input": x, "labels": np.argmax(x @ teacher, axis=-1).astype(np.int64)}, None


def _bert(rng):
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import real_models

    module, _ = real_models.build("bert")
    ids = rng.integers(2, 100, (CYCLE, 4, 8)).astype(np.int64)
    mask = np.ones((CYCLE, 4, 8), np.int64)
    mask[:, :, 6:] = rng.integers(0, 2, (CYCLE, 4, 2))
    model = real_models.export(module, {"input_ids": torch.from_numpy(ids[0]),
                                        "attention_mask": torch.from_numpy(mask[0])}, "torchscript")
    training = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-3, weight_decay=0.01),
                                       clip_grad_norm=1.0)
    labels = (ids[:, :, 0] % 3).astype(np.int64)
    return training, {"input_ids": ids, "attention_mask": mask, "labels": labels}, \
        schedules.WarmupCosineLR(warmup_steps=20, total_steps=STEPS)


def _cnn(rng):
    def tensor(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [tensor("conv1.w", 6, 1, 3, 3), tensor("conv1.b", 6), tensor("bn.scale", 6, scale=0.1),
             tensor("bn.bias", 6, scale=0.1), tensor("bn.mean", 6, scale=0.1),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, 6).astype(np.float32), "bn.var"),
             tensor("conv2.w", 8, 6, 3, 3), tensor("conv2.b", 8), tensor("fc.w", 8, 10), tensor("fc.b", 10)]
    inits[2].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(inits[2]) + 1, "bn.scale"))
    nodes = [helper.make_node("Conv", ["image", "conv1.w", "conv1.b"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["n1"]),
             helper.make_node("Relu", ["n1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    training = ot.build_training_model(model, "cross_entropy", ot.Momentum(lr=0.05, momentum=0.9, nesterov=True),
                                       mode="train")
    images = rng.standard_normal((CYCLE, 16, 1, 8, 8)).astype(np.float32)
    labels = (images.reshape(CYCLE, 16, -1)[:, :, :10].argmax(-1)).astype(np.int64)
    return training, {"image": images, "labels": labels}, schedules.StepLR(step_size=50, gamma=0.5)


def _gpt2(rng):
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import real_models

    from onnx_training_ops.builder.losses import CrossEntropyLoss

    module, _ = real_models.build("gpt2")
    ids = rng.integers(2, 100, (CYCLE, 4, 8)).astype(np.int64)
    lengths = rng.integers(3, 9, (CYCLE, 4))
    mask = (np.arange(8) < lengths[..., None]).astype(np.int64)  # right padding: each row's own length
    ids[mask == 0] = 0  # the pad token
    model = real_models.export(module, {"input_ids": torch.from_numpy(ids[0]),
                                        "attention_mask": torch.from_numpy(mask[0])}, "torchscript")
    # momentum SGD: Adam would turn the attention key bias's gradient, exactly zero but for rounding,
    # into steps of up to lr that two roundings (session, export) take apart over 200 steps
    training = ot.build_training_model(model, CrossEntropyLoss(class_axis=-1, shift_labels=True),
                                       ot.Momentum(lr=0.005, momentum=0.9))
    labels = np.where(mask == 1, ids, -100)  # no loss on the padding
    return training, {"input_ids": ids, "attention_mask": mask, "labels": labels}, None


MODELS = {"mlp": _mlp, "bert": _bert, "cnn": _cnn, "gpt2": _gpt2}


def _lora_int4(rng, directory: Path):
    """LoRA on a tiny int4 Llama built by onnxruntime-genai's builder (MatMulNBits,
    GroupQueryAttention, SkipSimplifiedLayerNormalization: onnxruntime's contrib ops, which
    the exported step keeps and onnxruntime-node and onnxruntime-web's wasm run)."""
    import genai_models as genai

    built = genai.tiny(str(directory / "genai"))
    model = ot.add_lora(built.onnx, rank=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    training = ot.build_training_model(model, ot.CrossEntropyLoss(shift_labels=True), ot.AdamW(lr=1e-2))
    ids = rng.integers(3, genai.TINY["vocab_size"], (CYCLE, 2, 12)).astype(np.int64)
    return training, {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}, None


LORA = {"lora_int4": _lora_int4}  # trained by js/test/lora.test.js (node, wasm and WebGPU)
LORA_STEPS = 20
LORA_WEBGPU_STEPS = 3  # SwiftShader compiles each WebGPU session's shaders for ~10 s: a short run (lora.test.js)


def write_model(name: str, out_dir: Path, steps: int = STEPS, state_after: tuple[int, ...] = ()) -> Path:
    """Export ``name`` fresh, train it ``steps`` steps in Python, write what JS must match
    (``expected_state.safetensors`` at the end, ``expected_state_<n>.safetensors`` after each
    ``n`` of ``state_after``)."""
    directory = out_dir / name
    rng = np.random.default_rng(0)
    training, batches, schedule = MODELS[name](rng) if name in MODELS else LORA[name](rng, directory)
    session = ot.TrainingSession(training)
    if schedule is not None:
        session.set_lr_schedule(schedule)
    shapes = {k: list(v.shape[1:]) for k, v in batches.items()}  # the WebGPU step's static shapes
    export_step(session, directory / "export", packed=True, target="webgpu", input_shapes=shapes)
    (directory / "batches.safetensors").write_bytes(safetensors.encode(batches))
    _write_host_expected(directory)
    losses, rates, returned = [], [], []
    for i in range(steps):
        rates.append(session.learning_rates)
        result = session.step({k: v[i % CYCLE] for k, v in batches.items()})
        losses.append(float(result["loss"]))
        returned.append({k: float(v) for k, v in result.items() if np.size(v) == 1})
        if i + 1 in state_after:
            (directory / f"expected_state_{i + 1}.safetensors").write_bytes(safetensors.encode(session.state_dict()))
    evaluation = session.evaluate({k: v[0] for k, v in batches.items()})
    (directory / "expected.json").write_text(json.dumps({
        "steps": steps, "cycle": CYCLE, "losses": losses, "learning_rates": rates, "returned": returned,
        "eval_loss": float(evaluation["loss"])}))
    (directory / "expected_state.safetensors").write_bytes(safetensors.encode(session.state_dict()))
    (directory / "export_state.safetensors").write_bytes(safetensors.encode(_train_export(directory, batches, rates)))
    return directory


def _write_host_expected(directory: Path) -> None:
    """``host_expected.json``: the WebGPU step's host program evaluated in Python
    (onnx_training_ops/export/host_program.py) for a few update counts, for the JavaScript
    evaluator (js/src/host_program.js) to match bit for bit."""
    from onnx_training_ops.export.host_program import run as run_host

    manifest = json.loads((directory / "export" / "manifest.json").read_text())
    host = manifest["webgpu"]["host"]
    rates = {e["name"]: np.float32(e["base"] * 0.37) for e in manifest["learning_rates"]}
    cases = []
    for t in (0, 1, 2, 9, 1000, 123456789, 2 ** 40):
        inputs = {**{k: np.array(v) for k, v in rates.items()}, **({manifest["counter"]: np.array(t, np.int64)}
                                                                  if manifest["counter"] else {})}
        values = run_host(host, inputs)
        cases.append({"inputs": {k: float(v) for k, v in inputs.items()},
                      "values": {n: float(values[n]) for n in [*host["outputs"], *(f["name"] for f in host["feeds"])]}})
    (directory / "host_expected.json").write_text(json.dumps(cases))


def _train_export(directory: Path, batches: dict, rates: list[dict]) -> dict:
    """The export's step model trained in Python's onnxruntime on the same batches and rates."""
    session = session_from_export(directory / "export")
    for i, step_rates in enumerate(rates):
        feeds = {k: v[i % CYCLE] for k, v in batches.items()}
        session.step({**feeds, **{k: np.array(v, np.float32) for k, v in step_rates.items()}})
    return session.state_dict()


def write_example(out_dir: Path) -> Path:
    """The browser example's export (``examples/browser/export_model.py``) in ``out_dir/example``."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "browser" / "export_model.py"
    spec = importlib.util.spec_from_file_location("browser_export_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_example(Path(out_dir) / "example")


SCHEDULES = [
    schedules.StepLR(step_size=7, gamma=0.3), schedules.MultiStepLR(milestones=(30, 5, 12), gamma=0.7),
    schedules.ExponentialLR(gamma=0.97), schedules.CosineAnnealingLR(T_max=17, eta_min=1e-4),
    schedules.LinearLR(start_factor=0.2, end_factor=0.9, total_iters=9),
    schedules.OneCycleLR(max_lr={"lr_a": 0.3, "lr_b": 0.05}, total_steps=60, pct_start=0.25),
    schedules.OneCycleLR(max_lr=0.2, total_steps=60, anneal_strategy="linear", three_phase=True),
    schedules.WarmupCosineLR(warmup_steps=6, total_steps=50, num_cycles=1.5),
    schedules.WarmupLinearLR(warmup_steps=5, total_steps=40),
]


def write_schedules(out_dir: Path, steps: int = 60) -> None:
    """Each schedule's rate at steps 0..steps for two learning-rate inputs (base 0.1 and 0.02)."""
    table = []
    for schedule in SCHEDULES:
        spec = json.loads(schedules.to_json(schedule, 0))
        rates = {name: [schedules.rate(schedule, base, k, name) for k in range(steps + 1)]
                 for name, base in (("lr_a", 0.1), ("lr_b", 0.02))}
        table.append({"type": spec["type"], "args": spec["args"], "bases": {"lr_a": 0.1, "lr_b": 0.02},
                      "rates": rates})
    (out_dir / "schedules.json").write_text(json.dumps(table))


def write_probes(out_dir: Path) -> None:
    """``probes/is_nan.onnx``: IsNaN as the WebGPU step lowers it (Not(Equal(x, x))), for the
    browser to check that WebGPU's Equal sees NaN as IEEE does."""
    from onnx_training_ops.passes.lower_is_nan import lower_is_nan

    graph = helper.make_graph([helper.make_node("IsNaN", ["x"], ["y"])], "is_nan",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                              [helper.make_tensor_value_info("y", TensorProto.BOOL, [6])])
    model = lower_is_nan(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    model.ir_version = 8
    (out_dir / "probes").mkdir(exist_ok=True)
    (out_dir / "probes" / "is_nan.onnx").write_bytes(model.SerializeToString())


def write_all(out_dir: Path, steps: int = STEPS) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_schedules(out_dir)
    write_probes(out_dir)
    for name in MODELS:
        write_model(name, out_dir, steps)
    write_example(out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/js_fixtures.py OUT_DIR")
    print(write_all(Path(sys.argv[1])))
