"""The lower_cross_entropy pass computes SoftmaxCrossEntropyLoss (loss and log_prob) as the
op's own definition does (onnx.reference), for the forms it lowers, and leaves the rest."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_training_ops.passes.lower_cross_entropy import lower_cross_entropy


def _model(n, c, dtype, label_type, reduction, ignore, weights=False):
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    inputs = ["scores", "labels"] + (["weights"] if weights else [])
    node = helper.make_node("SoftmaxCrossEntropyLoss", inputs, ["loss", "log_prob"], name="ce", **attrs)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph_inputs = [helper.make_tensor_value_info("scores", elem, [n, c]),
                    helper.make_tensor_value_info("labels", label_type, [n])]
    if weights:
        graph_inputs.append(helper.make_tensor_value_info("weights", elem, [c]))
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info("loss", elem, []),
                               helper.make_tensor_value_info("log_prob", elem, [n, c])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("label_type", [TensorProto.INT64, TensorProto.INT32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [None, -100, 2])
@pytest.mark.parametrize("c", [150, 40])  # the gather form, the one-hot form
def test_lowered_loss_equals_the_reference(dtype, label_type, reduction, ignore, c):
    n = 12  # C > 100: ignore_index -100 must not wrap around to class 50
    model = _model(n, c, dtype, label_type, reduction, ignore)
    lowered = lower_cross_entropy(_model(n, c, dtype, label_type, reduction, ignore))
    assert not any(x.op_type == "SoftmaxCrossEntropyLoss" for x in lowered.graph.node)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, c, n).astype(helper.tensor_dtype_to_np_dtype(label_type))
    if ignore is not None:
        labels[[1, 5]] = ignore
    feeds = {"scores": rng.standard_normal((n, c)).astype(dtype), "labels": labels}
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol)


def test_forms_it_does_not_lower_are_left_alone():
    model = _model(4, 3, np.float32, TensorProto.INT64, "mean", None, weights=True)
    assert [x.op_type for x in lower_cross_entropy(model).graph.node] == ["SoftmaxCrossEntropyLoss"]
    model = _model(4, 3, np.float32, TensorProto.INT64, "none", None)
    assert [x.op_type for x in lower_cross_entropy(model).graph.node] == ["SoftmaxCrossEntropyLoss"]
