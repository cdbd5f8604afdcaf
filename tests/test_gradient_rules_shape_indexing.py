"""Slicing, indexing, Einsum, ConvTranspose and Resize rules against float64 central finite
differences, and ConvTranspose/Resize/Einsum against torch autograd (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from test_gradient_rules import check, rand
from test_gradient_rules_activation_norm import FLOAT32_ONLY, _torch_parity

I64 = np.int64


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("dynamic", [False, True])
def test_split_with_an_unused_output(opset, dynamic):
    rng = np.random.default_rng(0)
    if opset >= 18:
        node = helper.make_node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3)
        inits = {}
    else:
        node = helper.make_node("Split", ["x", "split"], ["a", "b", "c"], axis=1)
        inits = {"split": np.array([1, 1, 1], I64)}
    nodes = [node, helper.make_node("Mul", ["a", "c"], ["z"])]  # b unused
    check(nodes, {"x": rand(rng, (2, 3, 4))}, ["x"], opset=opset, initializers=inits,
          dynamic=dynamic)


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [3], [1], [1]),
    ([0, -1], [2, -5], [0, 2], [1, -2]),
    ([-100], [100], [2], [2]),
    ([3], [0], [1], [-1]),
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_slice(starts, ends, axes, steps, dynamic):
    rng = np.random.default_rng(1)
    inits = {"s": np.array(starts, I64), "e": np.array(ends, I64), "a": np.array(axes, I64),
             "t": np.array(steps, I64)}
    check([helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["z"])],
          {"x": rand(rng, (3, 4, 5))}, ["x"], initializers=inits, dynamic=dynamic)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [16, 18])
def test_pad(mode, opset):
    rng = np.random.default_rng(2)
    inputs, inits = ["x", "p"], {"p": np.array([0, 1, 2, 0, 2, 1], I64)}
    feeds = {"x": rand(rng, (2, 3, 4))}
    xs = ["x"]
    if mode == "constant":
        inputs.append("v")
        feeds["v"] = np.array(0.3)
        xs.append("v")
    check([helper.make_node("Pad", inputs, ["z"], mode=mode)], feeds, xs, opset=opset,
          initializers=inits)


def test_pad_with_axes():
    rng = np.random.default_rng(3)
    inits = {"p": np.array([1, 2, 0, 1], I64), "ax": np.array([0, -1], I64)}
    check([helper.make_node("Pad", ["x", "p", "", "ax"], ["z"], mode="reflect")],
          {"x": rand(rng, (3, 4))}, ["x"], initializers=inits)


@pytest.mark.parametrize("dynamic", [False, True])
def test_tile(dynamic):
    rng = np.random.default_rng(4)
    check([helper.make_node("Tile", ["x", "r"], ["z"])], {"x": rand(rng, (2, 3))}, ["x"],
          initializers={"r": np.array([2, 3], I64)}, dynamic=dynamic)


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu(upper):
    rng = np.random.default_rng(5)
    check([helper.make_node("Trilu", ["x", "k"], ["z"], upper=upper)],
          {"x": rand(rng, (2, 4, 4))}, ["x"], initializers={"k": np.array(1, I64)})


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(exclusive, reverse):
    rng = np.random.default_rng(6)
    check([helper.make_node("CumSum", ["x", "ax"], ["z"], exclusive=exclusive, reverse=reverse)],
          {"x": rand(rng, (3, 4))}, ["x"], initializers={"ax": np.array(1, I64)})


def test_gather_elements_repeated_and_negative_indices():
    rng = np.random.default_rng(7)
    idx = np.array([[0, -1, 0], [1, 1, -3]], I64)
    check([helper.make_node("GatherElements", ["x", "i"], ["z"], axis=1)],
          {"x": rand(rng, (2, 3))}, ["x"], initializers={"i": idx})


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(batch_dims):
    rng = np.random.default_rng(8)
    if batch_dims == 0:
        idx = np.array([[0, 1], [1, 2], [0, 1]], I64)
    else:
        idx = np.array([[1], [0]], I64)
    check([helper.make_node("GatherND", ["x", "i"], ["z"], batch_dims=batch_dims)],
          {"x": rand(rng, (2, 3, 4))}, ["x"], initializers={"i": idx})


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_nd(reduction):
    rng = np.random.default_rng(9)
    idx = np.array([[0, 1], [1, 2]], I64)
    check([helper.make_node("ScatterND", ["x", "i", "u"], ["z"], reduction=reduction)],
          {"x": rand(rng, (2, 3, 4)), "u": rand(rng, (2, 4))}, ["x", "u"],
          initializers={"i": idx})


def test_scatter_elements():
    rng = np.random.default_rng(10)
    idx = np.array([[2, 0], [1, 3]], I64)
    check([helper.make_node("ScatterElements", ["x", "i", "u"], ["z"], axis=1)],
          {"x": rand(rng, (2, 4)), "u": rand(rng, (2, 2))}, ["x", "u"], initializers={"i": idx})


@pytest.mark.parametrize("equation,shapes", [
    ("ij,jk->ik", [(2, 3), (3, 4)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("ij,j", [(2, 3), (3,)]),
    ("ij->j", [(2, 3)]),
    ("ij,kl->ijkl", [(2, 3), (1, 2)]),
    ("...ij,...jk->...ik", [(2, 2, 3), (2, 3, 2)]),
])
def test_einsum(equation, shapes):
    rng = np.random.default_rng(11)
    names = [f"x{i}" for i in range(len(shapes))]
    feeds = {n: rand(rng, s) for n, s in zip(names, shapes)}
    check([helper.make_node("Einsum", names, ["z"], equation=equation)], feeds, names)


@pytest.mark.parametrize("attrs", [
    {},
    {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
    {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
    {"strides": [1, 2], "auto_pad": "SAME_LOWER"},
])
def test_conv_transpose(attrs):
    rng = np.random.default_rng(12)
    group = attrs.get("group", 1)
    feeds = {"x": rand(rng, (2, 4, 3, 3)), "w": rand(rng, (4, 6 // group, 2, 3)),
             "b": rand(rng, (6,))}
    check([helper.make_node("ConvTranspose", ["x", "w", "b"], ["z"], **attrs)], feeds,
          ["x", "w", "b"], **FLOAT32_ONLY)


RESIZE_CASES = [
    {"mode": "nearest"},
    {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
    {"mode": "linear"},
    {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
    {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
    {"mode": "cubic", "cubic_coeff_a": -0.75},
]


@pytest.mark.parametrize("attrs", RESIZE_CASES)
@pytest.mark.parametrize("by", ["scales", "sizes"])
def test_resize(attrs, by):
    rng = np.random.default_rng(13)
    if by == "scales":
        inputs, inits = ["x", "", "sc"], {"sc": np.array([1, 1, 2, 1.5], np.float32)}
    else:
        inputs, inits = ["x", "", "", "sz"], {"sz": np.array([2, 3, 5, 7], I64)}
    check([helper.make_node("Resize", inputs, ["z"], **attrs)], {"x": rand(rng, (2, 3, 3, 4))},
          ["x"], initializers=inits, **FLOAT32_ONLY)


def test_conv_transpose_resize_einsum_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    _torch_parity([helper.make_node("ConvTranspose", ["x", "w"], ["z"], strides=[2, 2],
                                    pads=[1, 1, 1, 1], output_padding=[1, 1])],
                  {"x": x, "w": w}, ["x", "w"],
                  lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
                  17)
    w2 = rng.standard_normal((4, 3, 2, 3)).astype(np.float32)  # groups (onnx.reference cannot)
    _torch_parity([helper.make_node("ConvTranspose", ["x", "w"], ["z"], strides=[2, 1],
                                    dilations=[1, 2], group=2)],
                  {"x": x, "w": w2}, ["x", "w"],
                  lambda x, w: F.conv_transpose2d(x, w, stride=(2, 1), dilation=(1, 2), groups=2),
                  17)
    sc = helper.make_tensor("sc", 1, [4], [1, 1, 2, 2])
    for mode, ctm, kw in [("nearest", "asymmetric", {"mode": "nearest"}),
                          ("linear", "pytorch_half_pixel", {"mode": "bilinear",
                                                            "align_corners": False}),
                          ("linear", "align_corners", {"mode": "bilinear",
                                                       "align_corners": True})]:
        nodes = [helper.make_node("Constant", [], ["sc"], value=sc),
                 helper.make_node("Resize", ["x", "", "sc"], ["z"], mode=mode,
                                  coordinate_transformation_mode=ctm, nearest_mode="floor")]
        _torch_parity(nodes, {"x": x}, ["x"],
                      lambda x, kw=kw: F.interpolate(x, scale_factor=2, **kw), 17)
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 5, 4)).astype(np.float32)
    _torch_parity([helper.make_node("Einsum", ["a", "b"], ["z"], equation="bqd,bkd->bqk")],
                  {"a": a, "b": b}, ["a", "b"],
                  lambda a, b: torch.einsum("bqd,bkd->bqk", a, b), 17)


@pytest.mark.parametrize("attrs", RESIZE_CASES[:5])
def test_resize_with_run_time_shapes_and_scales(attrs):
    """Dims and scales known only at run time: the matrix is built in the graph."""
    rng = np.random.default_rng(15)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["s"], ["sf"], to=1),
             helper.make_node("Div", ["sf", "sf"], ["ones"]),
             helper.make_node("Mul", ["ones", "k"], ["sc"]),
             helper.make_node("Resize", ["x", "", "sc"], ["z"], **attrs)]
    check(nodes, {"x": rand(rng, (2, 3, 3, 4))}, ["x"], dynamic=True,
          initializers={"k": np.array([1, 1, 2, 1.5], np.float32)}, **FLOAT32_ONLY)
