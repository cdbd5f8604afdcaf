"""No surprise aliasing (issue 10, part 2): ``InferenceSession.run`` never modifies a caller's
numpy feeds, on any path; in-place updates happen only where the caller asks for them
(IOBinding with one OrtValue bound as input and output, or TrainingSession's state buffers)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from model_factory import optimizer_model
from onnx import TensorProto

import onnx_training_ops as ot

ATTRIBUTES = {
    "Adam": dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.01, norm_coefficient_post=0.0),
    "Momentum": dict(alpha=0.9, beta=0.5, mode="nesterov", norm_coefficient=0.01),
    "Adagrad": dict(decay_factor=0.1, epsilon=1e-6, norm_coefficient=0.0),
}
DTYPES = [(np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)]


def _model_and_feeds(op_type, elem, dtype):
    model = optimizer_model(op_type, n=3, shapes=[[64, 8], [8], []], elem_type=elem, attributes=ATTRIBUTES[op_type])
    rng = np.random.default_rng(1)
    feeds = {}
    for value in model.graph.input[2:]:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = np.asarray(np.abs(rng.standard_normal(shape)) + 0.1, dtype)
    feeds["R"] = np.array(0.1, np.float32)
    feeds["T"] = np.array(2, np.int64)
    return model, feeds


def _sessions(model):
    plugin = ot.InferenceSession(model)
    portable = ort.InferenceSession(ot.prepare(model, portable=True).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    return {"plugin": plugin, "portable": portable}


@pytest.mark.parametrize("dtype, elem", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("op_type", sorted(ATTRIBUTES))
def test_run_never_modifies_the_callers_feeds(op_type, dtype, elem):
    model, feeds = _model_and_feeds(op_type, elem, dtype)
    before = {k: v.copy() for k, v in feeds.items()}
    for path, session in _sessions(model).items():
        for _ in range(2):  # a second run would see a first run's in-place write
            outputs = session.run(None, feeds)
            for name, value in feeds.items():
                np.testing.assert_array_equal(value, before[name], err_msg=f"{path}: feed {name!r} changed")
            for out in outputs:
                assert not any(np.shares_memory(out, v) for v in feeds.values()), f"{path}: an output aliases a feed"


@pytest.mark.parametrize("dtype, elem", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("op_type", sorted(ATTRIBUTES))
def test_iobinding_updates_in_place_where_the_caller_binds_one_value_as_input_and_output(op_type, dtype, elem):
    model, feeds = _model_and_feeds(op_type, elem, dtype)
    kernel = ot.kernels.REFERENCE_KERNELS[op_type]
    attrs = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in ATTRIBUTES[op_type].items()}
    tensor_inputs = [i.name for i in model.graph.input[2:]]
    expected = kernel(feeds["R"], feeds["T"], *[feeds[n] for n in tensor_inputs], **attrs)
    outputs = [o.name for o in model.graph.output]
    for path, session in _sessions(model).items():
        state = {name: ort.OrtValue.ortvalue_from_numpy(feeds[name].copy()) for name in tensor_inputs}
        binding = session.io_binding()
        for name in ("R", "T"):
            binding.bind_cpu_input(name, feeds[name])
        for name, value in state.items():
            binding.bind_ortvalue_input(name, value)
        for out in outputs:  # X0_new -> X0, V1_new -> V1, ...: the same OrtValue in and out
            binding.bind_ortvalue_output(out, state[out.removesuffix("_new")])
        session.run_with_iobinding(binding)
        for out, want in zip(outputs, expected):
            np.testing.assert_allclose(state[out.removesuffix("_new")].numpy(), want, rtol=1e-6,
                                       err_msg=f"{path}: {out} not updated in place")
