"""On a GPU (onnxruntime-gpu with the CUDA EP, see ../shared/gpu/README.md): TrainingSession
with its state on the device, and an export trained by DeviceTrainer, equal the CPU; the step
runs entirely on the CUDA EP (no Memcpy node) and replays a CUDA graph. Skipped (with the
reason) where onnxruntime has no CUDA EP: CI and this project's development machines."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.export import DeviceTrainer, export_step

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
pytestmark = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                reason="needs onnxruntime-gpu's CUDAExecutionProvider (no GPU here)")


def _fp32_cuda():  # TF32 off: fp32 parity with the CPU
    return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


def _batches(n=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 32, 64)).astype(np.float32)
    return [{"input": x[i], "labels": rng.integers(0, 10, 32).astype(np.int64)} for i in range(n)]


def _model():
    return ot.build_training_model(make_mlp((64, 128, 10)), "cross_entropy", ot.AdamW(lr=1e-3, weight_decay=0.01),
                                   clip_grad_norm=1.0)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static+graph"])
def test_training_session_on_cuda_equals_the_cpu_with_the_state_on_the_gpu(static):
    shapes = {"input": [32, 64], "labels": [32]} if static else None
    gpu = ot.TrainingSession(_model(), _fp32_cuda(), input_shapes=shapes)
    cpu = ot.TrainingSession(_model())
    assert gpu.device == "cuda" and gpu.cuda_graph == static
    assert all(v.device_name().lower() == "cuda" for v in gpu._store.memory.values.values())
    for batch in _batches():
        np.testing.assert_allclose(gpu.step(batch)["loss"], cpu.step(batch)["loss"], rtol=1e-5)
    want = cpu.state_dict()
    for name, value in gpu.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    for batch in _batches(2, 3):  # accumulation, then a step again
        gpu.backward(batch)
        cpu.backward(batch)
    np.testing.assert_allclose(gpu.optimizer_step()["grad_norm"], cpu.optimizer_step()["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(gpu.evaluate(_batches(1, 1)[0])["loss"], cpu.evaluate(_batches(1, 1)[0])["loss"],
                               rtol=1e-5)


def test_the_static_step_runs_entirely_on_the_cuda_ep(capfd):
    """No Memcpy node: onnxruntime names each one it inserts at log level 1 (info)."""
    options = ort.SessionOptions()
    options.log_severity_level = 1
    session = ot.TrainingSession(_model(), _fp32_cuda(), sess_options=options, cuda_graph=False,
                                 input_shapes={"input": [32, 64], "labels": [32]})
    session.step(_batches(1)[0])
    log = capfd.readouterr()
    text = log.out + log.err
    # "N Memcpy nodes are added to the graph ..." (warning), "Add MemcpyFromHost after t70 ..." (info)
    inserted = [line for line in text.splitlines()
                if "Memcpy" in line and any(w in line for w in ("added", " after ", " before "))]
    assert not inserted, inserted
    step = session._programs.steps[0].session
    assert "CUDAExecutionProvider" in step.get_providers()


def test_device_trainer_on_cuda_equals_the_cpu_with_the_state_on_the_gpu(tmp_path):
    export_step(_model(), tmp_path)
    gpu = DeviceTrainer(tmp_path, providers=_fp32_cuda())
    cpu = DeviceTrainer(tmp_path)
    assert gpu.providers[0] == "CUDAExecutionProvider" and gpu.device == "cuda"
    assert all(v.device_name().lower() == "cuda" for v in gpu.session._store.memory.values.values())
    for batch in _batches():
        np.testing.assert_allclose(gpu.step(batch)["loss"], cpu.step(batch)["loss"], rtol=1e-5)
    want = cpu.state_dict()
    for name, value in gpu.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(gpu.evaluate(_batches(1, 1)[0])["loss"], cpu.evaluate(_batches(1, 1)[0])["loss"],
                               rtol=1e-5)


def test_a_causal_lm_step_replays_a_cuda_graph_with_no_cpu_node_and_the_cpu_losses(capfd, tmp_path, monkeypatch):
    """GPT-2 (tiny) with input_shapes on the CUDA EP: no Memcpy node (the label shift was an int64
    Pad, which has no CUDA kernel), so the step replays a CUDA graph, its flat optimizer's Concats
    of at most 32 pieces included (issue 39 items 4, 6); the losses are the host session's."""
    pytest.importorskip("transformers")
    from benchmarks import zoo
    from benchmarks.model_runners import training_model

    monkeypatch.setenv("ONNX_TRAINING_OPS_ZOO", str(tmp_path))
    spec = zoo.spec("gpt2", layers=2, vocab=128, hidden=32, heads=2, batch=2, seq=8)
    batches = zoo.batches(spec, 3)
    options = ort.SessionOptions()
    options.log_severity_level = 1
    gpu = ot.TrainingSession(training_model(spec), _fp32_cuda(), sess_options=options,
                             input_shapes={k: list(v.shape) for k, v in batches[0].items()})
    cpu = ot.TrainingSession(training_model(spec))
    ours = [float(gpu.step(batches[i % 3])["loss"]) for i in range(8)]
    log = capfd.readouterr()
    inserted = [line for line in (log.out + log.err).splitlines()
                if "Memcpy" in line and any(w in line for w in ("added", " after ", " before "))]
    assert not inserted, inserted
    assert gpu.cuda_graph
    np.testing.assert_allclose(ours, [float(cpu.step(batches[i % 3])["loss"]) for i in range(8)], rtol=1e-4)


def test_frozen_tensors_train_on_cuda_with_a_cuda_graph_and_accumulation():
    """A LoRA-like model (a frozen 4 KB weight): bound once on the GPU for every program, the
    step captured as a CUDA graph (issue 39 items 1 and 5), backward working (issue 36 B.9)."""
    from tests.test_device_session import _frozen_model

    model = _frozen_model()
    shapes = {"x": [5, 16], "target": [5, 4]}
    gpu, cpu = ot.TrainingSession(model, _fp32_cuda(), input_shapes=shapes), ot.TrainingSession(model)
    assert gpu.cuda_graph, gpu._programs.steps[0].not_captured
    rng = np.random.default_rng(0)
    for _ in range(4):
        feeds = {"x": rng.standard_normal((5, 16)).astype(np.float32),
                 "target": rng.standard_normal((5, 4)).astype(np.float32)}
        np.testing.assert_allclose(gpu.step(feeds)["loss"], cpu.step(feeds)["loss"], rtol=1e-5)
    gpu.backward(feeds)
    cpu.backward(feeds)
    gpu.optimizer_step()
    cpu.optimizer_step()
    np.testing.assert_allclose(gpu.state_dict()["W1"], cpu.state_dict()["W1"], rtol=1e-4, atol=1e-6)


def test_a_conv_net_trains_on_cuda_with_cudnn_convolution_gradients():
    """Issue 39 item 8: on CUDA the Conv gradients are Conv/ConvTranspose, not im2col Gemms."""
    from tests.test_device_session import _conv_model

    gpu, cpu = ot.TrainingSession(_conv_model(), _fp32_cuda()), ot.TrainingSession(_conv_model())
    ops = [n.op_type for n in gpu._programs.steps[0].session.prepared_model.graph.node]
    assert "ConvTranspose" in ops
    rng = np.random.default_rng(1)
    for _ in range(3):
        batch = {"x": rng.standard_normal((6, 3, 8, 8)).astype(np.float32), "labels": rng.integers(0, 5, 6)}
        np.testing.assert_allclose(gpu.step(batch)["loss"], cpu.step(batch)["loss"], rtol=1e-4)
