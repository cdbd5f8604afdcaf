"""Every derivative rule against float64 central finite differences, through onnxruntime.

Each case differentiates ``y = op(...) * R`` (R a random constant, so a wrong transpose or
permutation of the output gradient cannot hide behind an all-ones seed); ``y`` is not a
scalar, which also exercises the sum-of-elements semantics. ``dynamic=True`` declares every
graph input with symbolic dims so the Shape-based (run-time) paths are taken.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradient_utils import check_gradient, forward_fn
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)


def weighted(nodes, inputs, z, opset=18, initializers=None, seed=0):
    """``nodes`` plus ``y = z * R``; returns (nodes, initializers)."""
    init = dict(initializers or {})
    shape = _shape_of(nodes, inputs, z, opset, init)
    init["R"] = np.random.default_rng(seed).uniform(0.5, 1.5, shape)
    return list(nodes) + [helper.make_node("Mul", [z, "R"], ["y"])], init


def _shape_of(nodes, inputs, z, opset, init):
    """The shape of ``z``, by onnx.reference."""
    graph = helper.make_graph(list(nodes), "s", [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in inputs.items()], [helper.make_value_info(z, helper.TypeProto())],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in init.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return np.asarray(ReferenceEvaluator(model).run(None, dict(inputs))[0]).shape


def check(nodes, inputs, xs, opset=18, initializers=None, dynamic=False, seed=0, **kw):
    z = nodes[-1].output[0]
    nodes, init = weighted(nodes, inputs, z, opset, initializers, seed)
    return check_gradient(nodes, inputs, "y", xs, opset=opset, initializers=init,
                          dynamic=dynamic, **kw)


def rand(rng, shape, lo=-1.0, hi=1.0):
    return rng.uniform(lo, hi, shape).astype(np.float64)


@st.composite
def broadcast_shapes(draw, n=2):
    rank = draw(st.integers(0, 3))
    out = [draw(st.integers(1, 3)) for _ in range(rank)]
    shapes = []
    for _ in range(n):
        r = draw(st.integers(0, rank))
        shapes.append(tuple(d if draw(st.booleans()) else 1 for d in out[rank - r:]))
    return shapes


# ------------------------------------------------------------------ element-wise binary
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
@given(shapes=broadcast_shapes(), dynamic=st.booleans(), seed=st.integers(0, 2**16))
@SETTINGS
def test_binary_broadcasting(op, shapes, dynamic, seed):
    rng = np.random.default_rng(seed)
    lo = 0.5 if op in ("Div", "Pow") else -1.0
    a, b = rand(rng, shapes[0], lo, 2.0), rand(rng, shapes[1], lo, 2.0)
    check([helper.make_node(op, ["a", "b"], ["z"])], {"a": a, "b": b}, ["a", "b"],
          dynamic=dynamic, seed=seed)


@given(shapes=broadcast_shapes(3), dynamic=st.booleans())
@SETTINGS
def test_sum_and_where(shapes, dynamic):
    rng = np.random.default_rng(1)
    a, b, c = (rand(rng, s) for s in shapes)
    nodes = [helper.make_node("Sum", ["a", "b", "c"], ["s"]),
             helper.make_node("Greater", ["a", "b"], ["m"]),
             helper.make_node("Where", ["m", "s", "c"], ["z"])]
    check(nodes, {"a": a, "b": b, "c": c}, ["a", "b", "c"], dynamic=dynamic)


def test_pow_integer_exponent_is_constant():
    rng = np.random.default_rng(2)
    check([helper.make_node("Pow", ["a", "e"], ["z"])],
          {"a": rand(rng, (3, 4), 0.5, 2)}, ["a"], initializers={"e": np.int64(3)})


# ------------------------------------------------------------------ element-wise unary
UNARY = {
    "Neg": (-1, 1), "Sqrt": (0.5, 2), "Exp": (-1, 1), "Log": (0.5, 2), "Abs": (0.1, 1),
    "Identity": (-1, 1), "Relu": (0.1, 1), "Sigmoid": (-2, 2), "Tanh": (-2, 2),
    "LeakyRelu": (0.1, 1),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@given(shape=st.lists(st.integers(1, 4), max_size=3), dynamic=st.booleans(),
       seed=st.integers(0, 2**16))
@SETTINGS
def test_unary(op, shape, dynamic, seed):
    rng = np.random.default_rng(seed)
    lo, hi = UNARY[op]
    x = rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)
    if op in ("Sqrt", "Log"):
        x = np.abs(x)
    attrs = {"alpha": 0.2} if op == "LeakyRelu" else {}
    check([helper.make_node(op, ["x"], ["z"], **attrs)], {"x": np.asarray(x)}, ["x"],
          dynamic=dynamic, seed=seed)


def test_cast_between_float_types():
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x32", "x32"], ["sq"]),
             helper.make_node("Cast", ["sq"], ["z"], to=TensorProto.DOUBLE)]
    check(nodes, {"x": rand(rng, (3, 4))}, ["x"], eps=1e-3, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset", [11, 13, 18])
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
@SETTINGS
def test_softmax_family(op, opset, shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    rng = np.random.default_rng(4)
    check([helper.make_node(op, ["x"], ["z"], axis=axis)], {"x": rand(rng, shape, -2, 2)},
          ["x"], opset=opset)


# ------------------------------------------------------------------ linear algebra
@st.composite
def matmul_shapes(draw):
    n, k, m = (draw(st.integers(1, 3)) for _ in range(3))
    batch = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]

    def operand(core):
        if draw(st.integers(0, 3)) == 0:
            return (k,)
        r = draw(st.integers(0, len(batch)))
        dims = [d if draw(st.booleans()) else 1 for d in batch[len(batch) - r:]]
        return tuple(dims) + core

    return operand((n, k)), operand((k, m))


@given(shapes=matmul_shapes(), dynamic=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, derandomize=True)
def test_matmul(shapes, dynamic, seed):
    rng = np.random.default_rng(seed)
    a, b = rand(rng, shapes[0]), rand(rng, shapes[1])
    check([helper.make_node("MatMul", ["a", "b"], ["z"])], {"a": a, "b": b}, ["a", "b"],
          dynamic=dynamic, seed=seed)


@pytest.mark.parametrize("c_shape", [None, (), (1,), (4,), (1, 4), (3, 1), (3, 4)])
@pytest.mark.parametrize("trans", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(trans, c_shape):
    rng = np.random.default_rng(5)
    ta, tb = trans
    a = rand(rng, (2, 3) if ta else (3, 2))
    b = rand(rng, (4, 2) if tb else (2, 4))
    inputs, xs = {"a": a, "b": b}, ["a", "b"]
    names = ["a", "b"]
    if c_shape is not None:
        inputs["c"] = rand(rng, c_shape)
        xs.append("c")
        names.append("c")
    node = helper.make_node("Gemm", names, ["z"], transA=ta, transB=tb, alpha=0.7, beta=1.3)
    check([node], inputs, xs, dynamic=c_shape == (3, 1))


# ------------------------------------------------------------------ reductions
@pytest.mark.parametrize("op,opset", [("ReduceSum", 11), ("ReduceSum", 13), ("ReduceSum", 18),
                                      ("ReduceMean", 13), ("ReduceMean", 17),
                                      ("ReduceMean", 18)])
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
@SETTINGS
def test_reductions(op, opset, shape, data):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(-rank, rank - 1), max_size=rank, unique_by=lambda a: a % rank))
    keepdims = data.draw(st.sampled_from([0, 1]))
    # before opset 13 an undecidable broadcast (symbolic dim vs. int) cannot be reduced
    dynamic = opset >= 13 and data.draw(st.booleans())
    axes_as_input = opset >= (13 if op == "ReduceSum" else 18)
    inits = {}
    if axes_as_input:
        noop = data.draw(st.sampled_from([0, 1]))
        inputs = ["x", "axes"] if axes or data.draw(st.booleans()) else ["x"]
        if len(inputs) == 2:
            inits["axes"] = np.asarray(axes, dtype=np.int64)
        node = helper.make_node(op, inputs, ["z"], keepdims=keepdims, noop_with_empty_axes=noop)
    else:
        node = helper.make_node(op, ["x"], ["z"], keepdims=keepdims,
                                **({"axes": axes} if axes else {}))
    rng = np.random.default_rng(6)
    check([node], {"x": rand(rng, shape)}, ["x"], opset=opset, initializers=inits,
          dynamic=dynamic)


def test_reduce_with_runtime_axes():
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["z"], keepdims=0)]
    model_inputs = {"x": rand(rng, (2, 3, 4)), "axes": np.asarray([0, 2], dtype=np.int64)}
    check(nodes, model_inputs, ["x"])


# ------------------------------------------------------------------ shape ops
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), dynamic=st.booleans(),
       data=st.data())
@SETTINGS
def test_reshape_flatten_transpose(shape, dynamic, data):
    rng = np.random.default_rng(8)
    x = rand(rng, shape)
    perm = data.draw(st.permutations(range(len(shape))))
    axis = data.draw(st.integers(0, len(shape)))
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=list(perm)),
             helper.make_node("Flatten", ["t"], ["f"], axis=axis),
             helper.make_node("Reshape", ["f", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["z"])]
    check(nodes, {"x": x}, ["x"], initializers={"shape": np.asarray([-1], dtype=np.int64)},
          dynamic=dynamic)


@pytest.mark.parametrize("opset", [11, 18])
def test_squeeze_unsqueeze(opset):
    rng = np.random.default_rng(9)
    if opset >= 13:
        nodes = [helper.make_node("Unsqueeze", ["x", "ax"], ["u"]),
                 helper.make_node("Squeeze", ["u", "sq"], ["z"])]
        inits = {"ax": np.asarray([0, 3], dtype=np.int64), "sq": np.asarray([0, 2], dtype=np.int64)}
    else:
        nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0, 3]),
                 helper.make_node("Squeeze", ["u"], ["z"], axes=[0, 2])]
        inits = {}
    check(nodes, {"x": rand(rng, (2, 1, 3))}, ["x"], opset=opset, initializers=inits)


@given(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data())
@SETTINGS
def test_concat(sizes, data):
    rank = data.draw(st.integers(1, 3))
    axis = data.draw(st.integers(-rank, rank - 1))
    base = [2] * rank
    rng = np.random.default_rng(10)
    inputs = {}
    for i, s in enumerate(sizes):
        shape = list(base)
        shape[axis] = s
        inputs[f"x{i}"] = rand(rng, shape)
    node = helper.make_node("Concat", list(inputs), ["z"], axis=axis)
    opset = data.draw(st.sampled_from([12, 18]))
    # before opset 13 Split takes static sizes: the dynamic case needs opset >= 13
    check([node], inputs, list(inputs), opset=opset,
          dynamic=opset >= 13 and data.draw(st.booleans()))


@pytest.mark.parametrize("axis,idx_shape", [(0, (5,)), (0, (2, 3)), (1, (4,)), (-1, (2, 2)),
                                            (0, ())])
@pytest.mark.parametrize("dynamic", [False, True])
def test_gather(axis, idx_shape, dynamic):
    rng = np.random.default_rng(11)
    data = rand(rng, (4, 3, 2))
    dim = data.shape[axis]
    idx = rng.integers(-dim, dim, idx_shape).astype(np.int64)
    if idx.size > 1:
        idx.reshape(-1)[0] = idx.reshape(-1)[1]  # a repeated index must accumulate
    check([helper.make_node("Gather", ["data", "idx"], ["z"], axis=axis)],
          {"data": data, "idx": idx}, ["data"], dynamic=dynamic)


# ------------------------------------------------------------------ convolution and pooling
CONV_CASES = [
    dict(),
    dict(strides=[2, 2]),
    dict(pads=[1, 0, 2, 1]),
    dict(pads=[1, 1, 1, 1], strides=[2, 1], dilations=[1, 2]),
    dict(group=2),
    dict(group=4, strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(auto_pad="SAME_LOWER", strides=[2, 1]),  # onnxruntime: no dilation with SAME
    dict(auto_pad="VALID", strides=[2, 2]),
]


@pytest.mark.parametrize("attrs", CONV_CASES, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "plain")
@pytest.mark.parametrize("dynamic", [False, True])
def test_conv(attrs, dynamic):
    rng = np.random.default_rng(12)
    group = attrs.get("group", 1)
    x = rand(rng, (2, 4, 7, 6))
    w = rand(rng, (4, 4 // group, 3, 2))
    b = rand(rng, (4,))
    node = helper.make_node("Conv", ["x", "w", "b"], ["z"], **attrs)
    check([node], {"x": x, "w": w, "b": b}, ["x", "w", "b"], dynamic=dynamic,
          analytic_dtype=np.float32, reference_fd=True, eps=1e-6, rtol=2e-4, atol=2e-5)


POOL_CASES = [
    dict(kernel_shape=[2, 2]),
    dict(kernel_shape=[3, 2], strides=[2, 1]),
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0]),
    dict(kernel_shape=[2, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
]


@pytest.mark.parametrize("attrs", POOL_CASES, ids=str)
@pytest.mark.parametrize("dynamic", [False, True])
def test_max_pool(attrs, dynamic):
    attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    rng = np.random.default_rng(13)
    x = rng.permutation(2 * 3 * 7 * 6).reshape(2, 3, 7, 6) / 10.0  # no ties
    check([helper.make_node("MaxPool", ["x"], ["z"], **attrs)], {"x": x}, ["x"],
          dynamic=dynamic, eps=1e-4)


@pytest.mark.parametrize("attrs", POOL_CASES, ids=str)
@pytest.mark.parametrize("dynamic", [False, True])
def test_average_pool(attrs, dynamic):
    rng = np.random.default_rng(14)
    check([helper.make_node("AveragePool", ["x"], ["z"], **attrs)], {"x": rand(rng, (2, 3, 7, 6))},
          ["x"], dynamic=dynamic, analytic_dtype=np.float32, reference_fd=True,
          rtol=2e-4, atol=2e-5)


# ------------------------------------------------------------------ losses
LOSS_CASES = [
    dict(reduction="mean"), dict(reduction="sum"), dict(reduction="none"),
    dict(reduction="mean", ignore_index=1), dict(reduction="mean", weights=True),
    dict(reduction="sum", weights=True, ignore_index=2),
    dict(reduction="none", weights=True, ignore_index=0),
]


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("case", LOSS_CASES, ids=str)
@pytest.mark.parametrize("extra_dims", [(), (2,)])
def test_losses(op, case, extra_dims):
    rng = np.random.default_rng(15)
    case = dict(case)
    weights = case.pop("weights", False)
    scores = rand(rng, (5, 4) + extra_dims, -2, 2)
    labels = rng.integers(0, 4, (5,) + extra_dims).astype(np.int64)
    labels.reshape(-1)[:2] = [1, 2]  # make sure ignore_index occurs
    inputs = {"scores": scores, "labels": labels}
    names = ["scores", "labels"]
    if weights:
        inputs["w"] = rng.uniform(0.5, 1.5, (4,))
        names.append("w")
    node = helper.make_node(op, names, ["z"], **case)
    check([node], inputs, ["scores"], opset=18)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_losses_with_int32_labels(op):
    """int32 labels (the rules compare and gather them as int64)."""
    rng = np.random.default_rng(19)
    inputs = {"scores": rand(rng, (5, 4), -2, 2), "labels": np.asarray([1, 3, 0, 1, 2], np.int32),
              "w": rng.uniform(0.5, 1.5, (4,))}
    node = helper.make_node(op, ["scores", "labels", "w"], ["z"], ignore_index=1)
    check([node], inputs, ["scores"], opset=18)


def test_softmax_cross_entropy_log_prob_output():
    rng = np.random.default_rng(16)
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["s", "l"], ["loss", "logp"]),
             helper.make_node("ReduceSum", ["logp"], ["t"], keepdims=0),
             helper.make_node("Mul", ["loss", "t"], ["z"])]
    check(nodes, {"s": rand(rng, (3, 4)), "l": np.asarray([0, 3, 1])}, ["s"])


@pytest.mark.parametrize("opset,mode", [(11, None), (18, None), (18, False)])
def test_dropout_inference_is_identity(opset, mode):
    rng = np.random.default_rng(17)
    inits, names = {}, ["x"]
    if mode is not None:
        inits = {"ratio": np.asarray(0.5), "mode": np.asarray(mode)}
        names = ["x", "ratio", "mode"]
    nodes = [helper.make_node("Dropout", names, ["d"]), helper.make_node("Tanh", ["d"], ["z"])]
    check(nodes, {"x": rand(rng, (3, 4))}, ["x"], opset=opset, initializers=inits)


def test_expand():
    rng = np.random.default_rng(18)
    nodes = [helper.make_node("Expand", ["x", "shape"], ["z"])]
    check(nodes, {"x": rand(rng, (3, 1))}, ["x"],
          initializers={"shape": np.asarray([2, 3, 4], dtype=np.int64)})


def test_forward_fn_reference_matches_runtime():
    """The float64 reference forward used for Conv agrees with onnxruntime where both run."""
    rng = np.random.default_rng(19)
    nodes = [helper.make_node("Tanh", ["x"], ["y"])]
    feeds = {"x": rand(rng, (3,))}
    assert abs(forward_fn(nodes, feeds, "y", 18)(feeds)
               - forward_fn(nodes, feeds, "y", 18, reference=True)(feeds)) < 1e-12


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (2, 3, 4, 3)])
@pytest.mark.parametrize("opset", [9, 15, 18])
def test_batch_normalization_inference(shape, opset):
    rng = np.random.default_rng(20)
    c = shape[1]
    inputs = {"x": rand(rng, shape), "scale": rand(rng, (c,)), "bias": rand(rng, (c,)),
              "mean": rand(rng, (c,)), "var": rand(rng, (c,), 0.5, 2.0)}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["z"],
                            epsilon=1e-3)
    check([node], inputs, list(inputs), opset=opset)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 3)])
def test_batch_normalization_training_mode(shape):
    """training_mode=1: y on the batch statistics (closed-form rule); the running-statistic
    inputs get no gradient (they do not reach y)."""
    rng = np.random.default_rng(21)
    c = shape[1]
    inputs = {"x": rand(rng, shape), "scale": rand(rng, (c,)), "bias": rand(rng, (c,)),
              "mean": rand(rng, (c,)), "var": rand(rng, (c,), 0.5, 2.0)}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"],
                            ["z", "running_mean", "running_var"], epsilon=1e-3, training_mode=1)
    check([node], inputs, ["x", "scale", "bias"], opset=15)


def test_batch_normalization_training_mode_matches_torch():
    torch = pytest.importorskip("torch")
    from test_gradient_rules_activation_norm import _torch_parity

    rng = np.random.default_rng(22)
    feeds = {"x": rng.standard_normal((4, 3, 5, 2)).astype(np.float32),
             "s": rng.standard_normal(3).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    inits = [helper.make_node("Constant", [], [k], value=helper.make_tensor(k, 1, [3], v))
             for k, v in (("m", [0.0] * 3), ("v", [1.0] * 3))]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["z", "rm", "rv"],
                            epsilon=1e-5, training_mode=1)
    _torch_parity(inits + [node], feeds, ["x", "s", "b"], lambda x, s, b: torch.nn.functional.batch_norm(
        x, None, None, s, b, training=True, eps=1e-5), 15)


def test_batch_normalization_on_its_input_batch_statistics():
    """The builder's mode="train" node: mean/var inputs are x's batch statistics (computed in
    the graph, marked by doc_string); the closed form covers their dependence on x."""
    from onnx_training_ops.autodiff.rules_norm import BATCH_STATISTICS_DOC

    rng = np.random.default_rng(23)
    inputs = {"x": rand(rng, (4, 3, 5)), "scale": rand(rng, (3,)), "bias": rand(rng, (3,))}
    inits = {"axes": np.array([0, 2], np.int64), "flat": np.array([-1], np.int64)}
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["c"]),
             helper.make_node("Mul", ["c", "c"], ["c2"]),
             helper.make_node("ReduceMean", ["c2", "axes"], ["v"], keepdims=1),
             helper.make_node("Reshape", ["m", "flat"], ["mf"]),
             helper.make_node("Reshape", ["v", "flat"], ["vf"]),
             helper.make_node("BatchNormalization", ["x", "scale", "bias", "mf", "vf"], ["z"], epsilon=1e-3,
                              doc_string=BATCH_STATISTICS_DOC)]
    check(nodes, inputs, list(inputs), opset=18, initializers=inits)
