"""TrainingSession never trains silently wrong on a provider it cannot use (GPU issue, item 1).

onnxruntime drops a provider that its build lacks with a logged warning and runs on the CPU:
an error naming the provider, raised before the model is loaded. A device provider would read
state bound from host arrays from a copy made once, at bind time: with one, the state lives on
the device (tests/test_device_session.py).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnx_training_ops import Adam, TrainingOpError, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.training.options.providers import placement


def _model():
    return build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Adam())


def test_default_and_explicit_cpu_train_and_report_their_provider():
    for providers in (None, ["CPUExecutionProvider"], [("CPUExecutionProvider", {})]):
        session = TrainingSession(_model(), providers=providers)
        assert session.providers == ["CPUExecutionProvider"]
        rng = np.random.default_rng(0)
        loss = session.step({"input": rng.standard_normal((4, 8)).astype(np.float32),
                             "labels": rng.integers(0, 3, 4)})["loss"]
        assert np.isfinite(loss)


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this onnxruntime has the CUDA EP: the missing-provider case needs a CPU-only build")
def test_cuda_without_onnxruntime_gpu_is_an_error_not_a_cpu_run():
    with pytest.raises(TrainingOpError, match=r"'CUDAExecutionProvider' not available.*onnxruntime-gpu"):
        TrainingSession(_model(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def test_an_available_device_provider_puts_the_state_on_its_device():
    available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    found = placement(["CUDAExecutionProvider", "CPUExecutionProvider"], available=available)
    assert (found.device, found.device_id) == ("cuda", 0)
    found = placement([("CUDAExecutionProvider", {"device_id": 2})], available=available)
    assert (found.device, found.device_id) == ("cuda", 2)
    assert placement(["CPUExecutionProvider"], available=available).device is None  # host arrays


@pytest.mark.parametrize("bad", [[], [5], [(3, {})]])
def test_malformed_provider_lists_are_errors(bad):
    with pytest.raises(TrainingOpError, match="providers"):
        placement(bad)


def test_a_refused_provider_loads_nothing(tmp_path):
    path = tmp_path / "missing.onnx"  # the provider check comes first: no file is opened
    with pytest.raises(TrainingOpError, match="providers"):
        TrainingSession(str(path), providers=["NoSuchExecutionProvider"])
