"""Direct adjoints of data-movement ops (no index tensor the size of the data): each rule
against float64 finite differences and torch autograd, and the ops it emits.

Slice -> Pad, Gather (a constant window) -> Pad, Gather (any indices) -> ScatterND on its
axis, Split <-> Concat, Expand -> ReduceSum, Transpose -> Transpose, MatMul with a 2-D
weight -> one Gemm; the element-number scatter stays the fallback (strided slices).
"""

from __future__ import annotations

import numpy as np
import pytest
from gradient_utils import gradient_model
from onnx import helper
from test_gradient_rules import check, rand
from test_gradient_rules_activation_norm import _torch_parity

from onnx_training_ops.passes.expand_gradient import expand_gradient

I64 = np.int64
INDEX_MAP_OPS = {"Range", "ScatterND", "ScatterElements"}


def _emitted_ops(nodes, feeds, xs, initializers=None) -> set[str]:
    model = gradient_model(nodes, feeds, nodes[-1].output[0], xs, initializers=initializers)
    forward = {n.name for n in nodes}
    return {n.op_type for n in expand_gradient(model).graph.node if n.name not in forward}


@pytest.mark.parametrize("starts,ends,axes", [
    ([1], [3], [1]), ([-3, 0], [100, -1], [2, 0]), ([0], [-1], None), ([-100], [2], [-1])])
def test_unit_step_slice_pads_the_gradient_back(starts, ends, axes):
    rng = np.random.default_rng(0)
    inits = {"s": np.array(starts, I64), "e": np.array(ends, I64)}
    inputs = ["x", "s", "e"] + (["a"] if axes is not None else [])
    if axes is not None:
        inits["a"] = np.array(axes, I64)
    nodes = [helper.make_node("Slice", inputs, ["z"])]
    feeds = {"x": rand(rng, (3, 4, 5))}
    check(nodes, feeds, ["x"], initializers=inits)
    ops = _emitted_ops(nodes, feeds, ["x"], inits)
    assert "Pad" in ops and not ops & INDEX_MAP_OPS, ops


def test_strided_slice_keeps_the_index_map_fallback():
    rng = np.random.default_rng(1)
    inits = {k: np.array(v, I64) for k, v in {"s": [0], "e": [5], "a": [2], "t": [2]}.items()}
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["z"])]
    feeds = {"x": rand(rng, (3, 4, 5))}
    check(nodes, feeds, ["x"], initializers=inits)
    assert "ScatterND" in _emitted_ops(nodes, feeds, ["x"], inits)


@pytest.mark.parametrize("indices,axis", [(np.array(2, I64), 1), (np.array([1, 2, 3], I64), 2),
                                          (np.array([[0, 1]], I64), 0), (np.array(-1, I64), -1)])
def test_gather_of_a_constant_window_pads_the_gradient_back(indices, axis):
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Gather", ["x", "i"], ["z"], axis=axis)]
    feeds = {"x": rand(rng, (3, 4, 5))}
    check(nodes, feeds, ["x"], initializers={"i": indices})
    ops = _emitted_ops(nodes, feeds, ["x"], {"i": indices})
    assert "Pad" in ops and not ops & INDEX_MAP_OPS, ops


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_with_repeated_indices_scatters_on_its_axis(axis):
    rng = np.random.default_rng(3)
    idx = np.array([[2, 0], [2, 2]], I64)
    nodes = [helper.make_node("Gather", ["x", "i"], ["z"], axis=axis)]
    check(nodes, {"x": rand(rng, (3, 4))}, ["x"], initializers={"i": idx})


def test_matmul_weight_gradient_is_one_gemm():
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["z"])]
    feeds = {"a": rand(rng, (2, 3, 4)), "w": rand(rng, (4, 5))}
    check(nodes, feeds, ["a", "w"])
    ops = _emitted_ops(nodes, feeds, ["w"])
    assert "Gemm" in ops and "MatMul" not in ops and "ReduceSum" not in ops, ops


def test_direct_adjoints_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    cases = [
        ([helper.make_node("Slice", ["x", "s", "e", "a"], ["z"])],
         {"s": np.array([1, -3], I64), "e": np.array([5, 100], I64), "a": np.array([1, 2], I64)},
         lambda x: x[:, 1:5, 1:]),
        ([helper.make_node("Gather", ["x", "i"], ["z"], axis=1)], {"i": np.array(0, I64)}, lambda x: x[:, 0]),
        ([helper.make_node("Split", ["x", "sp"], ["p", "q"], axis=1), helper.make_node("Mul", ["p", "q"], ["z"])],
         {"sp": np.array([3, 3], I64)}, lambda x: x[:, :3] * x[:, 3:]),
        ([helper.make_node("Concat", ["x", "x"], ["c"], axis=2), helper.make_node("Mul", ["c", "c"], ["z"])],
         {}, lambda x: torch.cat([x, x], 2) ** 2),
        ([helper.make_node("Expand", ["x", "sh"], ["z"])], {"sh": np.array([3, 2, 6, 4], I64)},
         lambda x: x.expand(3, 2, 6, 4)),
        ([helper.make_node("Transpose", ["x"], ["z"], perm=[2, 0, 1])], {}, lambda x: x.permute(2, 0, 1)),
    ]
    for nodes, inits, fn in cases:
        model_nodes = [helper.make_node("Constant", [], [k], value=helper.make_tensor(k, 7, v.shape, v.reshape(-1)))
                       for k, v in inits.items()] + nodes
        _torch_parity(model_nodes, {"x": x}, ["x"], lambda x, fn=fn: fn(x), 18)
    _torch_parity([helper.make_node("MatMul", ["x", "w"], ["z"])], {"x": x, "w": w}, ["x", "w"],
                  lambda x, w: x @ w, 18)
