"""Activations, normalizations and reductions against float64 central finite differences,
and the normalizations against torch autograd (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from gradient_utils import gradient_model, run_expanded
from onnx import helper
from test_gradient_rules import check, rand

# onnxruntime has no float64 kernel (or onnx no float64 schema) for these: the gradient runs
# in float32, the differences in float64 by onnx.reference
NO_DOUBLE_KERNEL = {"Erf", "Gelu", "Celu", "InstanceNormalization", "GlobalMaxPool",
                    "GlobalAveragePool"}
FLOAT32_ONLY = dict(analytic_dtype=np.float32, reference_fd=True, rtol=2e-4, atol=2e-5)

ACTIVATIONS = {
    # op: (attributes, opset, input range)
    "Erf": ({}, 18, (-2, 2)),
    "Gelu": ({}, 20, (-3, 3)),
    "Gelu-tanh": ({"approximate": "tanh"}, 20, (-3, 3)),
    "HardSigmoid": ({"alpha": 0.3, "beta": 0.4}, 18, (-4, 4)),
    "HardSwish": ({}, 18, (-5, 5)),
    "Softplus": ({}, 18, (-3, 3)),
    "Softsign": ({}, 18, (-3, 3)),
    "Elu": ({"alpha": 0.7}, 18, (-2, 2)),
    "Selu": ({}, 18, (-2, 2)),
    "Celu": ({"alpha": 1.3}, 18, (-2, 2)),
    "Mish": ({}, 18, (-3, 3)),
    "ThresholdedRelu": ({"alpha": 0.3}, 18, (-2, 2)),
    "Reciprocal": ({}, 18, (0.5, 2)),
    "Sin": ({}, 18, (-3, 3)),
    "Cos": ({}, 18, (-3, 3)),
}


def _away_from_kinks(x, kinks, gap=1e-3):
    for k in kinks:
        close = np.abs(x - k) < gap
        x = np.where(close, x + 2 * gap, x)
    return x


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_activation(name, dynamic):
    attrs, opset, (lo, hi) = ACTIVATIONS[name]
    op = name.split("-")[0]
    rng = np.random.default_rng(len(name))
    x = rand(rng, (3, 4), lo, hi)
    x = _away_from_kinks(x, {"HardSigmoid": [-4 / 3, 2], "HardSwish": [-3, 3],
                             "ThresholdedRelu": [0.3]}.get(op, [0.0]))
    kw = FLOAT32_ONLY if op in NO_DOUBLE_KERNEL else {}
    if op in ("Erf", "Gelu"):  # onnx.reference's erf is an approximation (errors ~1e-8)
        kw = dict(kw, eps=1e-3)
    check([helper.make_node(op, ["x"], ["z"], **attrs)], {"x": x}, ["x"], opset=opset,
          dynamic=dynamic, **kw)


def test_prelu_broadcast_slope():
    rng = np.random.default_rng(1)
    x = rand(rng, (2, 3, 4))
    x = np.where(np.abs(x) < 1e-3, 0.1, x)
    check([helper.make_node("PRelu", ["x", "s"], ["z"])],
          {"x": x, "s": rand(rng, (3, 1), 0.1, 0.5)}, ["x", "s"])


@pytest.mark.parametrize("opset", [12, 13])
def test_clip(opset):
    rng = np.random.default_rng(2)
    x = rand(rng, (3, 5), -2, 2)
    node = helper.make_node("Clip", ["x", "lo", "hi"], ["z"])
    check([node], {"x": x, "lo": np.array(-0.5), "hi": np.array(0.7)}, ["x", "lo", "hi"],
          opset=opset)


def test_clip_with_only_max():
    rng = np.random.default_rng(3)
    node = helper.make_node("Clip", ["x", "", "hi"], ["z"])
    check([node], {"x": rand(rng, (4,)), "hi": np.array(0.2)}, ["x", "hi"])


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_variadic_broadcasting(op):
    rng = np.random.default_rng(4)
    a, b, c = rand(rng, (2, 3)), rand(rng, (3,)), rand(rng, (2, 1))
    check([helper.make_node(op, ["a", "b", "c"], ["z"])], {"a": a, "b": b, "c": c},
          ["a", "b", "c"])


def test_max_ties_split_evenly_like_torch():
    torch = pytest.importorskip("torch")
    a = np.array([1.0, 2.0, 3.0])
    b = np.array([1.0, 0.0, 3.0])
    got = run_expanded(gradient_model([helper.make_node("Max", ["a", "b"], ["y"])],
                                      {"a": a, "b": b}, "y", ["a", "b"]), {"a": a, "b": b})
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    torch.maximum(ta, tb).sum().backward()
    np.testing.assert_allclose(got["d_a"], ta.grad.numpy())
    np.testing.assert_allclose(got["d_b"], tb.grad.numpy())


REDUCTIONS = ["ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2", "ReduceLogSumExp",
              "ReduceSumSquare", "ReduceProd"]


@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [0, 2], None])
def test_reductions(op, opset, keepdims, axes):
    rng = np.random.default_rng(5)
    x = rand(rng, (2, 3, 4), 0.5, 2) * rng.choice([-1.0, 1.0], (2, 3, 4))
    inputs, inits = ["x"], {}
    attrs = {"keepdims": keepdims}
    if axes is not None:
        if opset >= 18:
            inputs.append("axes")
            inits["axes"] = np.array(axes, np.int64)
        else:
            attrs["axes"] = axes
    check([helper.make_node(op, inputs, ["z"], **attrs)], {"x": x}, ["x"], opset=opset,
          initializers=inits)


# ------------------------------------------------------------------ normalizations
@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("dynamic", [False, True])
def test_layer_norm(axis, dynamic):
    rng = np.random.default_rng(6)
    x = rand(rng, (2, 3, 4))
    normalized = x.shape[axis:] if axis >= 0 else x.shape[axis:]
    scale, bias = rand(rng, normalized), rand(rng, normalized)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["z"], axis=axis,
                            epsilon=1e-3)
    check([node], {"x": x, "s": scale, "b": bias}, ["x", "s", "b"], opset=17, dynamic=dynamic,
          rtol=1e-4, atol=1e-6)


def test_instance_norm():
    rng = np.random.default_rng(7)
    node = helper.make_node("InstanceNormalization", ["x", "s", "b"], ["z"], epsilon=1e-3)
    check([node], {"x": rand(rng, (2, 3, 4, 2)), "s": rand(rng, (3,)), "b": rand(rng, (3,))},
          ["x", "s", "b"], **FLOAT32_ONLY)


@pytest.mark.parametrize("opset", [18, 21])
def test_group_norm(opset):
    rng = np.random.default_rng(8)
    params = 2 if opset < 21 else 4
    node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["z"], num_groups=2,
                            epsilon=1e-3)
    # opset 21 computes the statistics in float32 (stash_type=1) even for float64 inputs:
    # wider differences keep that rounding out of the comparison
    tol = dict(eps=1e-2, rtol=2e-3, atol=1e-5) if opset >= 21 else dict(rtol=1e-4, atol=1e-6)
    check([node], {"x": rand(rng, (2, 4, 3)), "s": rand(rng, (params,)),
                   "b": rand(rng, (params,))}, ["x", "s", "b"], opset=opset, **tol)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_global_pools(op, dynamic):
    rng = np.random.default_rng(9)
    check([helper.make_node(op, ["x"], ["z"])], {"x": rand(rng, (2, 3, 4, 3))}, ["x"],
          dynamic=dynamic, **FLOAT32_ONLY)


def _torch_parity(nodes, feeds, xs, torch_fn, opset):
    """Expanded gradient (float32) vs torch autograd of sum(torch_fn(*tensors) * w)."""
    torch = pytest.importorskip("torch")
    z = nodes[-1].output[0]
    rng = np.random.default_rng(0)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    out = torch_fn(**tensors)
    w = rng.uniform(0.5, 1.5, tuple(out.shape)).astype(np.float32)
    (out * torch.tensor(w)).sum().backward()
    model = gradient_model(list(nodes) + [helper.make_node("Mul", [z, "weights"], ["y"])], feeds,
                           "y", xs, opset=opset, initializers={"weights": w})
    got = run_expanded(model, feeds)
    for x in xs:
        want = tensors[x].grad.numpy()
        err = np.abs(got[f"d_{x}"] - want).max() / np.abs(want).max()
        assert err < 1e-5, (x, err)


def test_norms_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 4, 5)).astype(np.float32)
    s, b = (rng.standard_normal(5).astype(np.float32) for _ in range(2))
    _torch_parity([helper.make_node("LayerNormalization", ["x", "s", "b"], ["z"], epsilon=1e-5)],
                  {"x": x, "s": s, "b": b}, ["x", "s", "b"],
                  lambda x, s, b: F.layer_norm(x, (5,), s, b, 1e-5), 17)
    s4, b4 = (rng.standard_normal(4).astype(np.float32) for _ in range(2))
    _torch_parity([helper.make_node("GroupNormalization", ["x", "s", "b"], ["z"], num_groups=2,
                                    epsilon=1e-5)],
                  {"x": x, "s": s4, "b": b4}, ["x", "s", "b"],
                  lambda x, s, b: F.group_norm(x, 2, s, b, 1e-5), 21)
    _torch_parity([helper.make_node("InstanceNormalization", ["x", "s", "b"], ["z"])],
                  {"x": x, "s": s4, "b": b4}, ["x", "s", "b"],
                  lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-5), 18)
    _torch_parity([helper.make_node("Gelu", ["x"], ["z"])], {"x": x}, ["x"],
                  lambda x: F.gelu(x), 20)


def test_cast_like_back_to_the_input_type():
    rng = np.random.default_rng(11)
    nodes = [helper.make_node("CastLike", ["x", "like"], ["x32"]),
             helper.make_node("Mul", ["x32", "x32"], ["sq"]),
             helper.make_node("CastLike", ["sq", "x"], ["z"])]
    check(nodes, {"x": rand(rng, (3, 2))}, ["x"], initializers={"like": np.float32(0)},
          eps=1e-3, rtol=1e-3, atol=1e-4)
