"""Mixed precision: the graph pass, fp16 training against torch, dynamic loss scaling against
torch.amp.GradScaler, the exported step, and bf16's limits on the CPU EP."""

from __future__ import annotations

import io
import json
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_training_ops as ot
from onnx_training_ops.builder.model_metadata import metadata
from onnx_training_ops.export import DeviceTrainer, export_step, session_from_export
from onnx_training_ops.passes.mixed_precision import CPU, CUDA, KERNELS_16BIT, LOWER_PRECISION_OPS, mixed_precision

torch = pytest.importorskip("torch")

STEPS = 10


def _mlp(rng, sizes=(8, 16, 4)) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x @ W1 + b1 -> Relu -> @ W2 + b2: the weights as float32 initializers."""
    weights = {"W1": rng.standard_normal(sizes[:2]).astype(np.float32) * 0.4,
               "b1": rng.standard_normal(sizes[1]).astype(np.float32) * 0.1,
               "W2": rng.standard_normal(sizes[1:]).astype(np.float32) * 0.4,
               "b2": rng.standard_normal(sizes[2]).astype(np.float32) * 0.1}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["o"], name="fc2"),
             helper.make_node("Add", ["o", "b2"], ["logits"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", sizes[2]])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


class TorchMLP(torch.nn.Module):
    def __init__(self, weights, half: bool | torch.dtype):
        super().__init__()
        self.p = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.tensor(v)) for k, v in weights.items()})
        self.low = torch.float16 if half is True else half or None

    def mm(self, a, b):  # torch autocast's rule for matmul: 16-bit inputs, here a float32 result
        return (a.to(self.low) @ b.to(self.low)).float() if self.low else a @ b

    def forward(self, x):
        r = torch.relu(self.mm(x, self.p["W1"]) + self.p["b1"])
        return self.mm(r, self.p["W2"]) + self.p["b2"]


def _batches(rng, n=STEPS, batch=16, features=8, classes=4):
    return [(rng.standard_normal((batch, features)).astype(np.float32), rng.integers(0, classes, batch))
            for _ in range(n)]


def _torch_losses(module, batches, scaler=None, lr=1e-2, loss_fn=torch.nn.functional.cross_entropy, clip=None):
    """torch's AdamW with GradScaler's step/update (and clipping after ``unscale_``), as torch's
    AMP recipe writes it."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    losses, scales = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(module(torch.tensor(x)), torch.tensor(y))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        losses.append(loss.item())
    return np.array(losses), scales


def _ours(model, batches, feed_names=("x", "labels"), **build):
    session = ot.TrainingSession(ot.build_training_model(model, build.pop("loss", "cross_entropy"),
                                                         ot.AdamW(lr=1e-2), **build))
    losses, scales = [], []
    for x, y in batches:
        losses.append(float(session.step(dict(zip(feed_names, (x, y))))["loss"]))
        scales.append(session.loss_scale)
    return np.array(losses), scales, session


# ---------------------------------------------------------------------------------------------- the pass


def test_matmuls_go_16_bit_between_casts_and_the_weights_stay_float32():
    model, _ = _mlp(np.random.default_rng(0))
    built = ot.build_training_model(model, "cross_entropy", ot.AdamW(), precision="fp16")
    onnx.checker.check_model(built, full_check=True)
    nodes = {n.output[0]: n for n in built.graph.node}
    for name, x, w in (("fc1", "x", "W1"), ("fc2", "r", "W2")):
        matmul = next(n for n in built.graph.node if n.name == name)
        for value, source in zip(matmul.input, (x, w)):
            cast = nodes[value]
            assert cast.op_type == "Cast" and cast.input[0] == source
            assert helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT16
        up = next(n for n in built.graph.node if n.input and n.input[0] == matmul.output[0])
        assert up.op_type == "Cast" and helper.get_attribute_value(up.attribute[0]) == TensorProto.FLOAT
    # the elementwise ops and the loss keep float32; the master weights and the optimizer state too
    assert {n.op_type for n in built.graph.node if n.op_type not in ("Cast", "MatMul")} == {"Add", "Relu"}
    assert all(t.data_type == TensorProto.FLOAT for t in built.graph.initializer)
    algo = built.training_info[0].algorithm
    assert all(t.data_type == TensorProto.FLOAT for t in algo.initializer if t.name.endswith((".V", ".H")))
    meta = metadata(built)
    assert meta["precision"] == "fp16" and meta["precision_provider"] == CUDA
    assert json.loads(meta["precision_nodes"]) == {"16-bit": ["fc1", "fc2"], "fp32": []}
    scaling = json.loads(meta["loss_scaling"])
    assert (scaling["init_scale"], scaling["growth_factor"], scaling["backoff_factor"],
            scaling["growth_interval"]) == (2.0 ** 16, 2.0, 0.5, 2000)  # torch GradScaler's defaults


def test_back_to_back_16_bit_nodes_share_the_16_bit_value():
    w1, w2 = (numpy_helper.from_array(np.eye(4, dtype=np.float32) * k, n) for k, n in ((2, "A"), (3, "B")))
    nodes = [helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w1, w2])
    model, report = mixed_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "fp16")
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Cast", "Cast", "MatMul", "Cast", "MatMul", "Cast"]  # no Cast up + down for h
    first, second = (n for n in model.graph.node if n.op_type == "MatMul")
    assert second.input[0] == first.output[0]
    assert report.converted == ("MatMul#0", "MatMul#1")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = ort.InferenceSession(model.SerializeToString(), providers=[CPU]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(out, x * 6)


def test_an_op_without_a_16_bit_kernel_on_the_target_provider_stays_float32():
    conv = numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "K")
    w = numpy_helper.from_array(np.ones((18, 3), np.float32), "W")
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "K"], ["c"], name="conv"), helper.make_node("Reshape", ["c", "shape"], ["f"]),
         helper.make_node("MatMul", ["f", "W"], ["y"], name="fc")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [conv, w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, bf16 = mixed_precision(onnx.ModelProto.FromString(model.SerializeToString()), "bf16")  # CUDA: no bf16 Conv
    assert (bf16.converted, bf16.kept_fp32, bf16.provider) == (("fc",), ("conv",), CUDA)
    _, fp16 = mixed_precision(onnx.ModelProto.FromString(model.SerializeToString()), "fp16")
    assert fp16.converted == ("conv", "fc")
    untouched, cpu = mixed_precision(onnx.ModelProto.FromString(model.SerializeToString()), "fp16", CPU)
    assert cpu.converted == () and cpu.kept_fp32 == ("conv", "fc")
    assert [n.op_type for n in untouched.graph.node] == ["Conv", "Reshape", "MatMul"]
    with pytest.raises(ot.TrainingOpError, match="precision_provider 'TpuExecutionProvider' has no 16-bit"):
        mixed_precision(model, "fp16", "TpuExecutionProvider")
    with pytest.raises(ot.TrainingOpError, match="precision must be 'fp32', 'fp16' or 'bf16', found 'int8'"):
        ot.build_training_model(_mlp(np.random.default_rng(0))[0], "cross_entropy", ot.Adam(), precision="int8")


def _inserted_casts(op: str, inputs: list[list[int]], attrs: dict) -> bool:
    """Whether onnxruntime's CPU EP runs a float16 ``op`` in float32 between casts it inserts."""
    graph = helper.make_graph([helper.make_node(op, [f"x{i}" for i in range(len(inputs))], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT16, shape)
                               for i, shape in enumerate(inputs)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with tempfile.TemporaryDirectory() as d:
        options.optimized_model_filepath = f"{d}/opt.onnx"
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
        ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])
        optimized = onnx.load(options.optimized_model_filepath)
    return any("InsertedPrecisionFreeCast" in name for n in optimized.graph.node for name in n.input)


@pytest.mark.parametrize("op,inputs,attrs", [
    ("MatMul", [[2, 3], [3, 4]], {}), ("Gemm", [[2, 3], [3, 4]], {}), ("Conv", [[1, 2, 5, 5], [3, 2, 3, 3]], {}),
    ("ConvTranspose", [[1, 2, 5, 5], [2, 3, 3, 3]], {}), ("Einsum", [[2, 3], [3, 4]], {"equation": "ij,jk->ik"})])
def test_the_cpu_kernel_table_matches_onnxruntime(op, inputs, attrs):
    """KERNELS_16BIT[CPU] lists an op exactly when onnxruntime's CPU EP has a float16 kernel for
    it (else onnxruntime computes it in float32 between casts it inserts)."""
    assert op in LOWER_PRECISION_OPS
    assert (op in KERNELS_16BIT[CPU]["fp16"]) == (not _inserted_casts(op, inputs, attrs))


# ---------------------------------------------------------------------------------------------- bf16


def test_bf16_builds_a_valid_graph_and_the_cpu_ep_refuses_it_clearly(tmp_path):
    model, _ = _mlp(np.random.default_rng(1))
    built = ot.build_training_model(model, "cross_entropy", ot.AdamW(), precision="bf16")
    onnx.checker.check_model(built, full_check=True)
    casts = [helper.get_attribute_value(n.attribute[0]) for n in built.graph.node if n.op_type == "Cast"]
    assert casts.count(TensorProto.BFLOAT16) == 4 and casts.count(TensorProto.FLOAT) == 2
    assert metadata(built)["precision"] == "bf16" and "loss_scaling" not in metadata(built)  # torch: no scaler for bf16
    with pytest.raises(ot.TrainingOpError, match=r"precision='bf16'.*CPUExecutionProvider.*bfloat16 kernels "
                                                 r"\(CUDAExecutionProvider.*DeviceTrainer.*fp16 runs on the CPU"):
        ot.TrainingSession(built)
    export_step(built, tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["precision"] == "bf16"
    with pytest.raises(ot.TrainingOpError, match=r"DeviceTrainer: the model is built with precision='bf16'"):
        DeviceTrainer(tmp_path)


def test_bf16_inference_graph_computes_what_bf16_rounding_gives():
    """The bf16 graph's forward, run by onnx.reference, equals float32 math on bf16-rounded
    matmul inputs (no onnxruntime kernel needed)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(2)
    model, weights = _mlp(rng)
    converted, _ = mixed_precision(model, "bf16")
    x = rng.standard_normal((3, 8)).astype(np.float32)
    got = ReferenceEvaluator(converted).run(None, {"x": x})[0]
    t = TorchMLP(weights, half=False)
    bf = lambda a: a.to(torch.bfloat16).float()  # noqa: E731
    xt = torch.tensor(x)
    r = torch.relu(bf(bf(xt) @ bf(t.p["W1"])) + t.p["b1"])
    want = bf(bf(r) @ bf(t.p["W2"])) + t.p["b2"]
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------- fp16 vs torch


def test_fp16_mlp_trains_like_torch_amp_and_like_fp32():
    rng = np.random.default_rng(3)
    model, weights = _mlp(rng)
    batches = _batches(rng)
    ours, scales, session = _ours(model, batches, precision="fp16")
    amp, torch_scales = _torch_losses(TorchMLP(weights, half=True), batches, torch.amp.GradScaler("cpu"))
    fp32, _ = _torch_losses(TorchMLP(weights, half=False), batches)
    np.testing.assert_allclose(ours, amp, rtol=1e-2)
    np.testing.assert_allclose(ours, fp32, rtol=2e-2)
    assert scales == torch_scales == [2.0 ** 16] * STEPS and session.overflow_steps == 0


class Block(torch.nn.Module):
    """A pre-norm transformer block and a classifier head; ``low``: every matmul in that 16-bit dtype."""

    def __init__(self, d=16, heads=2, classes=5):
        super().__init__()
        self.d, self.heads, self.low = d, heads, None
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.head = torch.nn.Linear(d, classes)

    def mm(self, a, b):
        return (a.to(self.low) @ b.to(self.low)).float() if self.low else a @ b

    def lin(self, layer, x):
        return self.mm(x, layer.weight.t()) + layer.bias

    def forward(self, x):
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = self.lin(self.qkv, self.ln1(x)).split(self.d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, dh).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(self.mm(q, k.transpose(-1, -2)) / dh ** 0.5, dim=-1)
        o = self.mm(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.lin(self.proj, o)
        x = x + self.lin(self.fc2, torch.nn.functional.gelu(self.lin(self.fc1, self.ln2(x))))
        return self.lin(self.head, x.mean(dim=1))


@pytest.fixture(scope="module")
def block():
    """The block's ONNX export (TorchScript exporter) and a function making torch copies of it."""
    torch.manual_seed(0)
    module = Block()
    with torch.no_grad():  # no two equal tensors (the exporter would tie them)
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    f = io.BytesIO()
    torch.onnx.export(module, (torch.randn(2, 6, 16),), f, dynamo=False, opset_version=17, do_constant_folding=False,
                      input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}})

    def copy(low=None):
        twin = Block()
        twin.load_state_dict(state)
        twin.low = low
        return twin

    return onnx.load_from_string(f.getvalue()), copy


def test_fp16_transformer_block_trains_like_torch_amp_and_like_fp32(block):
    model, copy = block
    rng = np.random.default_rng(4)
    batches = [(rng.standard_normal((4, 6, 16)).astype(np.float32), rng.integers(0, 5, 4)) for _ in range(STEPS)]
    ours, scales, session = _ours(model, batches, precision="fp16")
    assert len(json.loads(session.metadata["precision_nodes"])["16-bit"]) == 7  # 5 Linear + 2 attention matmuls
    amp, torch_scales = _torch_losses(copy(torch.float16), batches, torch.amp.GradScaler("cpu"))
    fp32, _ = _torch_losses(copy(), batches)
    np.testing.assert_allclose(ours, amp, rtol=1e-2)
    np.testing.assert_allclose(ours, fp32, rtol=2e-2)
    assert scales == torch_scales


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_transformer_block_step_in_real_16_bit_math_trains_like_torch(block, precision, tmp_path):
    """The exported step in onnx.reference (16-bit arithmetic) against torch's 16-bit matmuls
    (and GradScaler for fp16): 1e-2 of them and 2e-2 of fp32, the issue's targets."""
    model, copy = block
    rng = np.random.default_rng(13)
    batches = [(rng.standard_normal((4, 6, 16)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32))
               for _ in range(6)]
    built = ot.build_training_model(model, "mse", ot.AdamW(lr=1e-2), precision=precision)
    ours, _, step = _reference_losses(built, batches, tmp_path)
    low = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    want, _ = _torch_losses(copy(low), batches, scaler, loss_fn=torch.nn.functional.mse_loss)
    fp32, _ = _torch_losses(copy(), batches, loss_fn=torch.nn.functional.mse_loss)
    np.testing.assert_allclose(ours, want, rtol=1e-2)
    np.testing.assert_allclose(ours, fp32, rtol=2e-2)
    # the whole 16-bit region, backward included, needs only kernels the CUDA EP has in bf16 and fp16
    low_type = TensorProto.FLOAT16 if precision == "fp16" else TensorProto.BFLOAT16
    assert _ops_on(step, low_type) == {"Cast", "MatMul", "Gemm", "Transpose", "Reshape"}


def _reference_losses(built, batches, directory):
    """Train the exported step with onnx.reference: real 16-bit arithmetic in numpy (float16,
    and bfloat16 through ml_dtypes), what a GPU's 16-bit kernels compute (up to their
    accumulation order). Returns the losses, the final state and the step model."""
    from onnx.reference import ReferenceEvaluator

    from onnx_training_ops.storage.safetensors import read

    manifest = export_step(built, directory)
    step = onnx.load(directory / "step.onnx")
    onnx.checker.check_model(step, full_check=True)  # types consistent in 16-bit, gradient included
    state, _ = read(directory / "state.safetensors")
    evaluator, names = ReferenceEvaluator(step), [o.name for o in step.graph.output]
    losses = []
    with np.errstate(over="ignore", invalid="ignore"):  # the overflows loss scaling is there for
        for x, target in batches:
            out = dict(zip(names, evaluator.run(None, {**state, "x": x, "target": target,
                                                       "learning_rate": np.array(1e-2, np.float32)})))
            losses.append(float(out["loss"]))
            state = {k: out[v] for k, v in manifest["feedback"].items()}
    return np.array(losses), state, step


def _ops_on(step: onnx.ModelProto, elem_type: int) -> set[str]:
    """The op types of ``step`` that read or write a value of ``elem_type``."""
    inferred = onnx.shape_inference.infer_shapes(step)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    return {n.op_type for n in graph.node if any(types.get(v) == elem_type for v in [*n.input, *n.output])}


def _regression_batches(rng, n=6):
    return [(rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32))
            for _ in range(n)]


def test_the_fp16_step_in_real_fp16_math_matches_torch_amp_and_its_grad_scaler(tmp_path):
    """In onnx.reference the 16-bit nodes compute in float16 (the CPU EP computes them in
    float32): the losses, the overflowing step it skips and the scale equal torch's."""
    rng = np.random.default_rng(11)
    model, weights = _mlp(rng)
    batches = _regression_batches(rng)
    built = ot.build_training_model(model, "mse", ot.AdamW(lr=1e-2), precision="fp16")
    ours, state, _ = _reference_losses(built, batches, tmp_path)
    scaler = torch.amp.GradScaler("cpu")
    amp, scales = _torch_losses(TorchMLP(weights, half=True), batches, scaler, loss_fn=torch.nn.functional.mse_loss)
    np.testing.assert_allclose(ours, amp, rtol=1e-3)
    assert float(state["loss_scale"]) == scales[-1] and int(state["loss_scale.skipped_steps"]) == sum(
        1 for a, b in zip([2.0 ** 16, *scales], scales) if b < a) >= 1  # an fp16 overflow, skipped by both
    assert int(state["optimizer.T"]) == len(batches) - int(state["loss_scale.skipped_steps"])


def test_the_bf16_step_in_real_bf16_math_trains_like_torch_bf16_and_fp32(tmp_path):
    rng = np.random.default_rng(12)
    model, weights = _mlp(rng)
    batches = _regression_batches(rng)
    built = ot.build_training_model(model, "mse", ot.AdamW(lr=1e-2), precision="bf16")
    ours, _, step = _reference_losses(built, batches, tmp_path)
    bf16, _ = _torch_losses(TorchMLP(weights, half=torch.bfloat16), batches, loss_fn=torch.nn.functional.mse_loss)
    fp32, _ = _torch_losses(TorchMLP(weights, half=False), batches, loss_fn=torch.nn.functional.mse_loss)
    np.testing.assert_allclose(ours, bf16, rtol=1e-2)
    np.testing.assert_allclose(ours, fp32, rtol=2e-2)
    assert np.max(np.abs(ours - fp32) / fp32) > 1e-5  # bfloat16's rounding shows: 16-bit math really ran


# ---------------------------------------------------------------------------------------------- loss scaling


def _regression(rng, scale_target):
    model, weights = _mlp(rng, sizes=(8, 16, 4))
    batches = [(rng.standard_normal((16, 8)).astype(np.float32),
                (rng.standard_normal((16, 4)) * scale_target).astype(np.float32)) for _ in range(STEPS)]
    return model, weights, batches


@pytest.mark.parametrize("clip", [None, 1.0])
def test_loss_scaling_follows_torch_grad_scaler_through_overflows_and_growth(clip):
    """A scale so large that the gradients overflow float32: torch's GradScaler (fp32 model,
    the same scaled loss) skips the same steps, backs off and grows the same way; clipping
    sees the unscaled gradients (torch: ``scaler.unscale_`` then ``clip_grad_norm_``)."""
    rng = np.random.default_rng(5)
    model, weights, batches = _regression(rng, 100.0)
    config = ot.LossScaling(init_scale=2.0 ** 126, growth_interval=3)
    ours, scales, session = _ours(model, batches, feed_names=("x", "target"), loss="mse", loss_scaling=config,
                                  clip_grad_norm=clip)
    scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale, growth_interval=config.growth_interval)
    want, torch_scales = _torch_losses(TorchMLP(weights, half=False), batches, scaler,
                                       loss_fn=torch.nn.functional.mse_loss, clip=clip)
    assert scales == torch_scales
    assert scales[0] < config.init_scale and max(scales) > min(scales)  # backed off, then grew
    skipped = sum(1 for before, after in zip([config.init_scale, *scales], scales) if after < before)
    assert session.overflow_steps == skipped >= 1
    assert int(session.state_dict()["optimizer.T"]) == STEPS - skipped  # T counts applied steps only
    np.testing.assert_allclose(ours, want, rtol=1e-5)


@pytest.mark.parametrize("precision,fast,optimizer", [
    ("fp16", True, ot.AdamW(lr=1e-2)), ("fp16", False, ot.AdamW(lr=1e-2)), ("fp32", True, ot.AdamW(lr=1e-2)),
    ("fp16", True, ot.Momentum(lr=1e-2, momentum=0.9)), ("fp16", True, ot.Adagrad(lr=1e-2)),
    ("fp16", True, ot.RMSProp(lr=1e-2))])
def test_an_overflowing_step_leaves_the_state_bit_identical(precision, fast, optimizer):
    rng = np.random.default_rng(6)
    model, _, batches = _regression(rng, 100.0)
    built = ot.build_training_model(model, "mse", optimizer, precision=precision,
                                    loss_scaling=ot.LossScaling(init_scale=2.0 ** 127, growth_interval=2))
    session = ot.TrainingSession(built, fast=fast)
    # the fast path's fused kernels apply the gated update (skipped when the gradients overflow)
    assert bool(session.fast_path_nodes) == (fast and not isinstance(optimizer, ot.RMSProp))
    x, target = batches[0]
    before = session.state_dict()
    out = session.step({"x": x, "target": target})
    after = session.state_dict()
    assert np.isfinite(out["loss"])  # a finite loss: only the (scaled) gradients overflowed
    scaling = {"loss_scale", "loss_scale.growth_tracker", "loss_scale.skipped_steps"}
    for name in before.keys() - scaling:
        assert after[name].tobytes() == before[name].tobytes(), name
    assert session.loss_scale == 2.0 ** 126 and session.overflow_steps == 1
    assert int(after["loss_scale.growth_tracker"]) == 0 and int(after["optimizer.T"]) == 0


def test_the_scale_grows_after_growth_interval_clean_steps_and_survives_a_checkpoint(tmp_path):
    rng = np.random.default_rng(7)
    model, _ = _mlp(rng)
    batches = _batches(rng, n=5)
    built = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2), precision="fp16",
                                    loss_scaling=ot.LossScaling(init_scale=8.0, growth_factor=4.0, growth_interval=2))
    session = ot.TrainingSession(built)
    seen = []
    for x, y in batches:
        session.step({"x": x, "labels": y})
        seen.append((session.loss_scale, int(session.state_dict()["loss_scale.growth_tracker"])))
    assert seen == [(8.0, 1), (32.0, 0), (32.0, 1), (128.0, 0), (128.0, 1)]
    session.save(tmp_path / "ckpt.onnx")
    again = ot.TrainingSession(tmp_path / "ckpt.onnx")
    assert again.loss_scale == 128.0 and again.overflow_steps == 0
    x, y = batches[0]
    session.step({"x": x, "labels": y})
    again.step({"x": x, "labels": y})
    assert again.loss_scale == session.loss_scale == 512.0


def test_accumulated_gradients_are_scaled_and_the_update_equals_a_step():
    """backward() keeps the scaled gradients (torch's .grad before scaler.unscale_);
    optimizer_step() unscales, checks and applies them: the same state as step()."""
    rng = np.random.default_rng(10)
    model, _ = _mlp(rng)
    built = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2), precision="fp16")
    stepped, accumulated = ot.TrainingSession(built), ot.TrainingSession(built)
    x, y = _batches(rng, n=1)[0]
    stepped.step({"x": x, "labels": y})
    accumulated.backward({"x": x, "labels": y})
    scale = accumulated.loss_scale
    unscaled = ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2),
                                                          precision="fp16", loss_scaling=False))
    unscaled.backward({"x": x, "labels": y})
    for name, g in accumulated.gradients().items():
        np.testing.assert_allclose(g / scale, unscaled.gradients()[name], rtol=1e-5, atol=1e-9)
    accumulated.optimizer_step()
    for name, value in stepped.state_dict().items():
        np.testing.assert_array_equal(accumulated.state_dict()[name], value, err_msg=name)


def test_loss_scaling_settings_are_checked():
    for bad, match in [(dict(init_scale=0.0), "init_scale must be a number > 0, finite in float32"),
                       (dict(init_scale=1e39), "init_scale must be a number > 0, finite in float32"),
                       (dict(growth_factor=1.0), "growth_factor must be > 1"),
                       (dict(backoff_factor=1.5), "backoff_factor must be < 1"),
                       (dict(growth_interval=0), "growth_interval must be an int >= 1")]:
        with pytest.raises(ot.TrainingOpError, match=match):
            ot.LossScaling(**bad)
    model, _ = _mlp(np.random.default_rng(0))
    with pytest.raises(ot.TrainingOpError, match="loss_scaling must be a LossScaling"):
        ot.build_training_model(model, "cross_entropy", ot.Adam(), precision="fp16", loss_scaling=2.0)
    off = ot.build_training_model(model, "cross_entropy", ot.Adam(), precision="fp16", loss_scaling=False)
    assert "loss_scaling" not in metadata(off) and ot.TrainingSession(off).loss_scale is None


# ---------------------------------------------------------------------------------------------- export


def test_the_exported_fp16_step_trains_like_the_session(tmp_path):
    rng = np.random.default_rng(8)
    model, _ = _mlp(rng)
    built = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2), precision="fp16",
                                    loss_scaling=ot.LossScaling(init_scale=2.0 ** 20, growth_interval=3))
    manifest = export_step(built, tmp_path)
    assert manifest["precision"] == "fp16" and manifest["loss_scaling"]["scale"] == "loss_scale"
    session, exported, device = ot.TrainingSession(built), session_from_export(tmp_path), DeviceTrainer(tmp_path)
    rate = np.array(1e-2, np.float32)
    for x, y in _batches(rng, n=6):
        want = session.step({"x": x, "labels": y})["loss"]
        np.testing.assert_allclose(exported.step({"x": x, "labels": y, "learning_rate": rate})["loss"], want, rtol=1e-6)
        np.testing.assert_allclose(device.step({"x": x, "labels": y})["loss"], want, rtol=1e-6)
    for state in (exported.state_dict(), device.state_dict()):
        assert float(state["loss_scale"]) == session.loss_scale == 2.0 ** 22
        assert int(state["optimizer.T"]) == 6


def test_the_summary_shows_the_precision():
    model, _ = _mlp(np.random.default_rng(9))
    session = ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.AdamW(), precision="fp16"))
    summary = session.summary()
    assert summary.precision["16-bit"] == ["fc1", "fc2"] and summary.to_dict()["precision"]["precision"] == "fp16"
    assert "precision: fp16 (2 nodes 16-bit, 0 kept float32; loss scaling from 65536)" in str(summary)
    assert ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.AdamW())).summary().precision is None


def test_the_command_line_builds_with_a_precision(tmp_path, capsys):
    from onnx_training_ops.cli import main
    from onnx_training_ops.demo import make_mlp

    onnx.save(make_mlp((8, 16, 4)), tmp_path / "mlp.onnx")
    assert main(["build", str(tmp_path / "mlp.onnx"), str(tmp_path / "train.onnx"), "--loss", "cross_entropy",
                 "--optimizer", "adamw", "--precision", "fp16"]) == 0
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "train.onnx"), "--json"]) == 0
    precision = json.loads(capsys.readouterr().out)["precision"]
    assert precision["precision"] == "fp16" and len(precision["16-bit"]) == 2
    assert precision["loss_scaling"]["init_scale"] == 2.0 ** 16


def test_a_model_forced_large_trains_the_same(monkeypatch, tmp_path):
    """The loss scale's state and the 16-bit graph through the large-model path (tensors detached
    as arrays): the same losses, scale and checkpoint."""
    from onnx_training_ops.storage import tensors

    rng = np.random.default_rng(14)
    model, _ = _mlp(rng)
    batches = _batches(rng, n=4)
    config = ot.LossScaling(init_scale=4.0, growth_interval=2)
    small, small_scales, _ = _ours(model, batches, precision="fp16", loss_scaling=config)
    monkeypatch.delenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", raising=False)
    monkeypatch.setattr(tensors, "LARGE_MODEL_BYTES", 64)
    large, large_scales, session = _ours(model, batches, precision="fp16", loss_scaling=config)
    np.testing.assert_array_equal(large, small)
    assert large_scales == small_scales == [4.0, 8.0, 8.0, 16.0]
    session.save(tmp_path / "big.onnx")
    assert ot.TrainingSession(tmp_path / "big.onnx").loss_scale == 16.0


def test_bench_gpu_runs_ours_in_fp16_on_the_cpu_and_names_the_bf16_limit(tmp_path):
    from benchmarks import gpu

    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--models", "mlp", "--contenders", "ours_fp16,ours_bf16,torch_fp32",
                     "--losses", "3", "--timed", "1", "--json", str(out)]) == 0
    results = {r["contender"]: r for r in json.loads(out.read_text())}
    # the CPU EP computes the fp16 nodes in float32: torch fp32's losses
    np.testing.assert_allclose(results["ours_fp16"]["losses"], results["torch_fp32"]["losses"], rtol=1e-4)
    error = results["ours_bf16"]["error"]
    assert "precision='bf16'" in error and "CPUExecutionProvider" in error


def test_the_device_session_trains_a_loss_scaled_model_like_the_host_session():
    """TrainingSession(device="cpu"): the state as OrtValues, the optimizer lowered to standard
    ops; the gated update and the scale's state give the host session's values, an overflowing
    step included."""
    rng = np.random.default_rng(15)
    model, _, batches = _regression(rng, 100.0)
    built = ot.build_training_model(model, "mse", ot.AdamW(lr=1e-2), precision="fp16",
                                    loss_scaling=ot.LossScaling(init_scale=2.0 ** 126, growth_interval=2))
    host, device = ot.TrainingSession(built), ot.TrainingSession(built, device="cpu")
    for x, target in batches[:6]:
        np.testing.assert_allclose(device.step({"x": x, "target": target})["loss"],
                                   host.step({"x": x, "target": target})["loss"], rtol=1e-5)
        assert device.loss_scale == host.loss_scale
    assert device.overflow_steps == host.overflow_steps >= 1
    bf16 = ot.build_training_model(model, "mse", ot.AdamW(lr=1e-2), precision="bf16")
    with pytest.raises(ot.TrainingOpError, match="precision='bf16'"):
        ot.TrainingSession(bf16, device="cpu")


# ---------------------------------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                reason="needs onnxruntime-gpu's CUDAExecutionProvider (no GPU here)")


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_block_trains_on_cuda_like_torch_with_every_node_on_the_gpu(block, precision, capfd):
    """On the CUDA EP (TF32 off): the device session's losses against torch's 16-bit matmuls on
    the GPU (GradScaler for fp16) and fp32, the issue's targets; no Memcpy node (a 16-bit node
    without a CUDA kernel would run on the CPU between two)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    model, copy = block
    rng = np.random.default_rng(16)
    batches = [(rng.standard_normal((4, 6, 16)).astype(np.float32), rng.integers(0, 5, 4)) for _ in range(STEPS)]
    options = ort.SessionOptions()
    options.log_severity_level = 1
    built = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2), precision=precision)
    session = ot.TrainingSession(built, [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"],
                                 sess_options=options, cuda_graph=False,
                                 input_shapes={"x": [4, 6, 16], "labels": [4]})
    ours = np.array([float(session.step({"x": x, "labels": y})["loss"]) for x, y in batches])
    log = capfd.readouterr()
    inserted = [line for line in (log.out + log.err).splitlines()
                if "Memcpy" in line and any(w in line for w in ("added", " after ", " before "))]
    assert not inserted, inserted
    torch.backends.cuda.matmul.allow_tf32 = False
    low = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def on_cuda(module, scaler=None):
        module = module.cuda()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(torch.tensor(x).cuda()), torch.tensor(y).cuda())
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            losses.append(loss.item())
        return np.array(losses)

    np.testing.assert_allclose(ours, on_cuda(copy(low), scaler), rtol=1e-2)
    np.testing.assert_allclose(ours, on_cuda(copy()), rtol=2e-2)
