"""The lean training graph: the cross-entropy gradient in the lowering's own terms (merged
with the forward by onnxruntime), ReLU's gradient from its output (so Gemm+Relu fuse), and
what that leaves."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gradient_utils import check_gradient
from onnx import helper

from onnx_training_ops import Adam, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.runtime.options import KERNELS_ENV


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [None, -100, 1, -1])
def test_float32_cross_entropy_gradient_matches_finite_differences(reduction, ignore):
    rng = np.random.default_rng(3)
    scores = rng.uniform(-2, 2, (6, 4))
    labels = np.asarray([1, 3, 0, 1, 2, 3], np.int64)
    if ignore is not None:
        labels[[0, 4]] = ignore
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], **attrs),
             helper.make_node("Mul", ["loss", "k"], ["y"])]
    check_gradient(nodes, {"scores": scores, "labels": labels}, "y", ["scores"], opset=18,
                   initializers={"k": np.asarray(1.5)}, analytic_dtype=np.float32, rtol=2e-3, atol=1e-5)


def _optimized(tmp_path, fast: bool, loss_kwargs=None) -> onnx.GraphProto:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    model = build_training_model(make_mlp((16, 32, 10)), "cross_entropy", Adam(lr=1e-3))
    TrainingSession(model, fast=fast, sess_options=so)
    return onnx.load(so.optimized_model_filepath).graph


def test_mlp_step_graph_is_lean(tmp_path, monkeypatch):
    """The standard-op form (PyOp path; the native path's graph is in test_native_loss_kernels)."""
    monkeypatch.setenv(KERNELS_ENV, "pyop")
    ops = [n.op_type for n in _optimized(tmp_path, fast=True).node]
    # hot and its count are computed once for loss and gradient; ReLU's gradient reads the
    # ReLU output, so the forward Gemm+Relu fuse; -100 needs no mapping before OneHot
    assert ops.count("OneHot") == 1
    assert ops.count("FusedGemm") == 1 and "Relu" not in ops
    assert not {"Equal", "Where", "Unsqueeze", "Identity", "Sign"} & set(ops)
    assert len(ops) <= 23, ops


def test_a_linear_layers_bias_gradient_is_one_product_with_ones(tmp_path):
    # onnxruntime's ReduceSum over the rows of a [64, 128] gradient takes ~4 us, MatMul(ones, g) ~0;
    # with a static batch (torch.onnx.export's default) the ones are a constant
    mlp = make_mlp((16, 32, 10))
    mlp.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 8
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    TrainingSession(build_training_model(mlp, "cross_entropy", Adam(lr=1e-3)), sess_options=so)
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]

    assert ops.count("MatMul") == 2 and "ReduceSum" not in ops, ops


@pytest.mark.parametrize("bias_shape", [(5,), (1, 5)])
def test_gemm_bias_gradient_as_a_row_sum_matches_finite_differences(bias_shape):
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1, beta=0.5),
             helper.make_node("Mul", ["y", "y"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    check_gradient(nodes, {"a": rng.standard_normal((4, 3)), "b": rng.standard_normal((5, 3)),
                           "c": rng.standard_normal(bias_shape)}, "loss", ["a", "b", "c"], opset=17)
