"""On a GPU (onnxruntime-gpu with the CUDA EP, see ../shared/gpu/README.md): an export trained
by DeviceTrainer with its state on the device equals the same trainer on the CPU, and
TrainingSession refuses the CUDA EP instead of training on stale parameters. Skipped (with the
reason) where onnxruntime has no CUDA EP: CI and this project's development machines."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
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


def test_training_session_refuses_the_cuda_ep_with_what_to_do():
    model = ot.build_training_model(make_mlp((64, 32, 10)), "cross_entropy", ot.AdamW(lr=1e-3))
    with pytest.raises(TrainingOpError, match="DeviceTrainer"):
        ot.TrainingSession(model, providers=CUDA)


def test_device_trainer_on_cuda_equals_the_cpu_with_the_state_on_the_gpu(tmp_path):
    model = ot.build_training_model(make_mlp((64, 128, 10)), "cross_entropy", ot.AdamW(lr=1e-3, weight_decay=0.01),
                                    clip_grad_norm=1.0)
    export_step(model, tmp_path)
    gpu = DeviceTrainer(tmp_path, providers=_fp32_cuda())
    cpu = DeviceTrainer(tmp_path)
    assert gpu.providers[0] == "CUDAExecutionProvider" and gpu.device == "cuda"
    assert all(v.device_name().lower() == "cuda" for v in gpu._state.values.values())
    for batch in _batches():
        np.testing.assert_allclose(gpu.step(batch)["loss"], cpu.step(batch)["loss"], rtol=1e-5)
    want = cpu.state_dict()
    for name, value in gpu.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(gpu.evaluate(_batches(1, 1)[0])["loss"], cpu.evaluate(_batches(1, 1)[0])["loss"],
                               rtol=1e-5)
