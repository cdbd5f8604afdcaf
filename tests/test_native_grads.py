"""Native backward kernels (``ai.onnx.contrib::Training*``, numba cfuncs): each against its
standard-op rule (the same Gemm around it: equal results) and float64 finite differences;
other paths keep the standard ops."""

from __future__ import annotations

import numpy as np
import pytest
from gradient_utils import finite_difference, forward_fn, gradient_model
from onnx import helper

import onnx_training_ops as ot
from onnx_training_ops.runtime import native

pytestmark = pytest.mark.skipif(not native.availability()[0], reason="native kernels unavailable here")

CONV = [  # N, C, O, H, W, K, stride, pad, dilation
    (2, 3, 4, 7, 6, 3, 1, 1, 1),
    (2, 3, 5, 8, 8, 3, 2, 1, 1),
    (1, 2, 3, 9, 7, 2, 2, 0, 2),
    (2, 4, 4, 6, 6, 1, 2, 0, 1),
    (2, 3, 2, 9, 9, 5, 3, 2, 1),
    (2, 3, 5, 17, 16, 3, 2, 1, 1),
]


def _conv(case):
    n, c, o, h, w, k, s, p, d = case
    rng = np.random.default_rng(sum(case))
    feeds = {"x": rng.standard_normal((n, c, h, w)), "w": rng.standard_normal((o, c, k, k))}
    bias = s == 2  # a bias on the strided cases: Gemm's C in the forward's Gemm form
    if bias:
        feeds["b"] = rng.standard_normal(o)
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], pads=[p, p + 1, p, p], strides=[s, s],
                            dilations=[d, d], kernel_shape=[k, k], name="conv")
    return [node], feeds


@pytest.fixture
def gemm_for_small_convs(monkeypatch):
    """The Gemm form for these small Convs too (below ``MIN_GEMM_COLUMNS`` output positions a
    session keeps onnxruntime's Conv, for precision: test_few_output_positions_keep_onnxruntimes_conv)."""
    import sys

    monkeypatch.setattr(sys.modules["onnx_training_ops.passes.conv_forward_gemm"], "MIN_GEMM_COLUMNS", 0)


@pytest.mark.parametrize("case", CONV, ids=str)
def test_im2col_col2im_equal_the_standard_op_rule_and_finite_differences(case, gemm_for_small_convs):
    """The native path also computes the forward Conv from the same columns (one Gemm,
    ``passes.conv_forward_gemm``): y equals onnxruntime's Conv."""
    nodes, feeds = _conv(case)
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    xs = list(feeds)
    model = gradient_model(nodes, f32, "y", xs, opset=17)
    native_model = ot.prepare(model, kernels="native")
    ops = {n.op_type for n in native_model.graph.node if n.domain == "ai.onnx.contrib"}
    assert ops == {"TrainingIm2Col", "TrainingCol2Im"}
    assert "Conv" not in [n.op_type for n in native_model.graph.node]
    assert not any(n.domain == "ai.onnx.contrib" for n in ot.prepare(model, kernels="pyop").graph.node)
    assert not any(n.domain == "ai.onnx.contrib" for n in ot.prepare(model, portable=True).graph.node)
    outs = ["y"] + [f"d_{x}" for x in xs]
    got = ot.InferenceSession(native_model).run(outs, f32)
    want = ot.InferenceSession(model, kernels="pyop").run(outs, f32)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    f = forward_fn(nodes, feeds, "y", 17, reference=True)
    for name, g in zip(xs, got[1:]):
        idx, fd = finite_difference(f, feeds, name, 1e-6)
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=2e-4, atol=2e-4, err_msg=name)


def test_few_output_positions_keep_onnxruntimes_conv():
    """Fewer than ``MIN_GEMM_COLUMNS`` output positions (N*oh*ow): onnxruntime's Conv, whose
    rounding equals torch float32's there, not the Gemm form (test_batchnorm_precision)."""
    nodes, feeds = _conv(CONV[1])
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    ops = [n.op_type for n in ot.prepare(gradient_model(nodes, f32, "y", list(feeds), opset=17),
                                         kernels="native").graph.node]
    assert ops.count("Conv") == 1 and "TrainingIm2Col" in ops


def test_a_conv_with_big_columns_stays_onnxruntimes(monkeypatch, gemm_for_small_convs):
    """Past ``MAX_COLUMN_ELEMENTS`` the forward Conv is not rewritten (its columns would live
    from the forward to the backward pass); the gradients still use the native columns and
    every value is the same."""
    import sys

    cap = sys.modules["onnx_training_ops.passes.conv_forward_gemm"]
    nodes, feeds = _conv(CONV[1])
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    model = gradient_model(nodes, f32, "y", list(feeds), opset=17)
    outs = ["y"] + [f"d_{x}" for x in feeds]
    columns = 3 * 3 * 3 * (2 * 4 * 5)  # C*kh*kw x N*oh*ow: 8x8 input, pads (1, 2, 1, 1), stride 2
    monkeypatch.setattr(cap, "MAX_COLUMN_ELEMENTS", columns)
    small = ot.prepare(model, kernels="native")
    monkeypatch.setattr(cap, "MAX_COLUMN_ELEMENTS", columns - 1)
    big = ot.prepare(model, kernels="native")
    assert "Conv" not in [n.op_type for n in small.graph.node]
    assert [n.op_type for n in big.graph.node].count("Conv") == 1
    assert "TrainingIm2Col" in [n.op_type for n in big.graph.node]
    for a, b in zip(ot.InferenceSession(big).run(outs, f32), ot.InferenceSession(small).run(outs, f32)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_wrong_geometry_is_an_error_naming_the_node():
    node = helper.make_node("TrainingIm2Col", ["x", "geo"], ["cols"], domain="ai.onnx.contrib", name="im2col_1")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, None),
                                            helper.make_tensor_value_info("geo", 7, None)],
                              [helper.make_tensor_value_info("cols", 1, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.contrib", 1)])
    model.ir_version = 8
    session = ot.InferenceSession(model)
    x = np.zeros((1, 2, 3, 3), np.float32)
    with pytest.raises(Exception, match="im2col_1"):
        session.run(None, {"x": x, "geo": np.array([1, 2, 3, 3], np.int64)})
