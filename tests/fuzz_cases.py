"""Seeded fuzz cases, run in subprocesses by tests/test_fuzz.py.

``python tests/fuzz_cases.py CATEGORY SEED START STOP`` runs cases START..STOP-1 of a
category and prints one JSON line per case as soon as it is done, so that the driver can
tell which case crashed or hung the process and carry on after it. Case ``i`` depends only
on (SEED, i). An outcome is

* ``ran``: a result equal to an independent reference (onnx.reference.ReferenceEvaluator,
  float64 central finite differences, a twin session fed the canonical feed, the values
  saved in the checkpoint);
* ``clean``: our error (TrainingOpError, ValueError or TypeError with a message), a failed
  step leaving the state bit-identical; for the drop-in InferenceSession also onnxruntime's
  own input errors (InvalidArgument/Fail with its message), as onnxruntime raises them;
* ``wrong``: anything else — a raw exception, a result off the reference, a failed step
  that changed the state, a damaged checkpoint loading different values.

Categories: ``graphs`` (optimizer nodes), ``gradients`` (Gradient nodes and the graph they
differentiate), ``training_models`` (a built training model's Adam/Gradient nodes, state and
bindings, one step against the spec's pseudo-code on finite-difference gradients),
``training_feeds`` (TrainingSession.step), ``inference_feeds`` (InferenceSession.run),
``checkpoints`` (damaged checkpoint bytes).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # this checkout's package, as pytest sees it

from model_factory import optimizer_model  # noqa: E402

import onnx_training_ops as ot  # noqa: E402
from onnx_training_ops.demo import make_mlp  # noqa: E402

CLEAN = (ot.TrainingOpError, ValueError, TypeError)
try:  # what onnxruntime itself raises for feeds that contradict the declared inputs
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
    ORT_INPUT_ERRORS: tuple = (InvalidArgument, Fail)
except ImportError:  # pragma: no cover
    ORT_INPUT_ERRORS = ()
TRAINING = "ai.onnx.preview.training"
OPS = ("Adam", "Momentum", "Adagrad")
Outcome = tuple[str, str, str]  # (outcome, kind, detail)


def _close(got, want, rtol=1e-5, atol=1e-6) -> bool:
    return len(got) == len(want) and all(
        np.shape(a) == np.shape(b) and np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        for a, b in zip(got, want))


def _clean(error: BaseException) -> bool:
    return bool(str(error).strip())


# ------------------------------------------------------------------ graphs: optimizer nodes
def _mutate_optimizer(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    node = model.graph.node[0]
    kind = str(rng.choice(["attr_value", "attr_type", "drop_input", "extra_input", "dtype", "shape",
                           "op_type", "duplicate_output", "unknown_attr", "empty_input",
                           "drop_output", "r_shape", "t_dtype"]))
    if kind == "attr_value" and node.attribute:
        a = node.attribute[int(rng.integers(len(node.attribute)))]
        if a.type == onnx.AttributeProto.FLOAT:
            a.f = float(rng.choice([np.nan, np.inf, -1.0, 0.0, 0.5, 1.0, 2.5, 1e30]))
        else:
            a.s = rng.choice([b"bogus", b"nesterov", b"standard", b""])
    elif kind == "attr_type" and node.attribute:
        a = node.attribute[int(rng.integers(len(node.attribute)))]
        name = a.name
        node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(name, [1, 2]))
    elif kind == "drop_input":
        del node.input[int(rng.integers(len(node.input)))]
    elif kind == "extra_input":
        node.input.append(node.input[int(rng.integers(len(node.input)))])
    elif kind == "dtype":
        vi = model.graph.input[int(rng.integers(len(model.graph.input)))]
        vi.type.tensor_type.elem_type = int(rng.choice([TensorProto.INT32, TensorProto.DOUBLE,
                                                        TensorProto.FLOAT16, TensorProto.BOOL]))
    elif kind == "shape":
        vi = model.graph.input[int(rng.integers(2, len(model.graph.input)))]
        vi.type.tensor_type.shape.dim.add().dim_value = int(rng.integers(1, 4))
    elif kind == "op_type":
        node.op_type = str(rng.choice(["Adam", "Momentum", "Adagrad", "Gradient", "Nope"]))
    elif kind == "duplicate_output" and len(node.output) > 1:
        node.output[1] = node.output[0]
    elif kind == "unknown_attr":
        node.attribute.append(helper.make_attribute("surprise", 1.0))
    elif kind == "empty_input":
        node.input[int(rng.integers(len(node.input)))] = ""
    elif kind == "drop_output":
        del node.output[-1]
        del model.graph.output[-1]
    elif kind == "r_shape":
        dims = model.graph.input[0].type.tensor_type.shape.dim
        dims.add().dim_value = int(rng.choice([1, 2]))
    elif kind == "t_dtype":
        model.graph.input[1].type.tensor_type.elem_type = TensorProto.FLOAT
    return kind


def _feeds_for(graph: onnx.GraphProto, rng: np.random.Generator) -> dict:
    feeds = {}
    for vi in graph.input:
        tt = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.float32
        shape = [d.dim_value if d.dim_value else 3 for d in tt.shape.dim]
        if vi.name == "T":
            feeds[vi.name] = np.full(shape, int(rng.integers(0, 5))).astype(dtype)
        elif vi.name == "R":
            feeds[vi.name] = np.full(shape, 0.1).astype(dtype)
        else:
            feeds[vi.name] = rng.uniform(0.1, 1.0, shape).astype(dtype)
    return feeds


def graph_case(ctx, rng: np.random.Generator, i: int) -> Outcome:
    op = OPS[i % 3]
    model = optimizer_model(op, n=int(rng.integers(1, 3)), shapes=[[3], [2, 2]])
    kinds = [] if i % 5 == 0 else [_mutate_optimizer(model, rng) for _ in range(int(rng.integers(1, 3)))]
    kind = "+".join(kinds) or "none"
    feeds = _feeds_for(model.graph, rng)
    stage = "load"
    try:
        session = ot.InferenceSession(model)
        stage = "run"
        got = session.run(None, feeds)
    except CLEAN as error:
        return ("clean" if _clean(error) else "wrong"), kind, str(error)
    except ORT_INPUT_ERRORS as error:  # from run(): onnxruntime's own checks of the feeds
        return ("clean" if stage == "run" and _clean(error) else "wrong"), kind, f"{stage}: {error}"
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"raw {type(error).__name__}: {error}"
    try:
        want = ReferenceEvaluator(model).run(None, feeds)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"ran although onnx.reference refuses it: {error}"
    if _close(got, want):
        return "ran", kind, ""
    return "wrong", kind, "result differs from onnx.reference"


# ------------------------------------------------------------------ gradients: Gradient nodes
def _gradient_model() -> onnx.ModelProto:
    """y = sum(tanh(x @ W + b) * tanh(x @ W + b)); Gradient(x, W, b) with xs = [x, W, b]."""
    rng = np.random.default_rng(5)
    w = helper.make_tensor("W", TensorProto.FLOAT, [3, 2], rng.standard_normal(6).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="matmul"),
             helper.make_node("Add", ["h", "b"], ["a"], name="add"),
             helper.make_node("Tanh", ["a"], ["t"], name="act"),
             helper.make_node("Mul", ["t", "t"], ["s"], name="square"),
             helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0, name="sum"),
             helper.make_node("Gradient", ["x", "W", "b"], ["dx", "dW", "db"], domain=TRAINING,
                              xs=["x", "W", "b"], y="y", name="grad")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "dx", "dW", "db")]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, [w]),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])


def _set_attr(node: onnx.NodeProto, attribute: onnx.AttributeProto) -> None:
    for a in list(node.attribute):
        if a.name == attribute.name:
            node.attribute.remove(a)
    node.attribute.append(attribute)


def _mutate_gradient(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    g = model.graph
    grad = g.node[-1]
    kind = str(rng.choice(["xs_unknown", "xs_drop", "xs_duplicate", "xs_ints", "y_unknown", "y_int",
                           "y_missing", "zs", "drop_input", "extra_input", "drop_output",
                           "extra_output", "dtype", "shape", "act", "op_unknown", "cast_int",
                           "order"]))
    if kind in _ATTRIBUTE_MUTATIONS:
        _mutate_gradient_attributes(kind, grad, g)
    else:
        _mutate_gradient_graph(kind, model, rng)
    return kind


_ATTRIBUTE_MUTATIONS = ("xs_unknown", "xs_drop", "xs_duplicate", "xs_ints", "y_unknown", "y_int", "y_missing", "zs")


def _mutate_gradient_attributes(kind: str, grad: onnx.NodeProto, g: onnx.GraphProto) -> None:
    """The Gradient node's xs / y / zs attributes broken (``kind``)."""
    if kind == "xs_unknown":
        _set_attr(grad, helper.make_attribute("xs", ["x", "nowhere", "b"]))
    elif kind == "xs_drop":
        _set_attr(grad, helper.make_attribute("xs", ["x", "W"]))
        del grad.input[2:]
        del grad.output[2:]
        del g.output[3:]
    elif kind == "xs_duplicate" and len(grad.input) > 1:
        _set_attr(grad, helper.make_attribute("xs", ["x", "x", "b"]))
        grad.input[1] = "x"
    elif kind == "xs_ints":
        _set_attr(grad, helper.make_attribute("xs", [1, 2, 3]))
    elif kind == "y_unknown":
        _set_attr(grad, helper.make_attribute("y", "nowhere"))
    elif kind == "y_int":
        g.node.insert(len(g.node) - 1, helper.make_node("ArgMax", ["s"], ["am"], keepdims=0))
        _set_attr(grad, helper.make_attribute("y", "am"))
    elif kind == "y_missing":
        for a in list(grad.attribute):
            if a.name == "y":
                grad.attribute.remove(a)
    elif kind == "zs":
        _set_attr(grad, helper.make_attribute("xs", ["x", "W"]))
        _set_attr(grad, helper.make_attribute("zs", ["b"]))
        del grad.output[2:]
        del g.output[3:]


def _mutate_gradient_graph(kind: str, model: onnx.ModelProto, rng: np.random.Generator) -> None:
    """The Gradient node's inputs or outputs, or the graph around it, broken (``kind``)."""
    g = model.graph
    grad = g.node[-1]
    if kind == "drop_input":
        del grad.input[int(rng.integers(len(grad.input)))]
    elif kind == "extra_input":
        grad.input.append("x")
    elif kind == "drop_output" and len(grad.output) > 1:
        del grad.output[-1]
        del g.output[-1]
    elif kind == "extra_output":
        grad.output.append("d_extra")
        g.output.append(helper.make_tensor_value_info("d_extra", TensorProto.FLOAT, None))
    elif kind == "dtype":
        vi = g.input[int(rng.integers(len(g.input)))]
        vi.type.tensor_type.elem_type = int(rng.choice([TensorProto.INT64, TensorProto.INT32,
                                                        TensorProto.DOUBLE, TensorProto.BOOL]))
    elif kind == "shape":
        dims = g.input[0].type.tensor_type.shape.dim
        dims[int(rng.integers(len(dims)))].dim_value = int(rng.choice([1, 4]))
    elif kind == "act":
        g.node[2].op_type = str(rng.choice(["Relu", "Sigmoid", "Exp", "Floor", "Sign", "Abs",
                                            "Softplus", "Neg", "Identity"]))
    elif kind == "op_unknown":
        g.node[2].op_type = str(rng.choice(["Nope", "Hardmax"]))
        if g.node[2].op_type == "Nope":
            g.node[2].domain = "com.example"
            model.opset_import.append(helper.make_opsetid("com.example", 1))
    elif kind == "cast_int":
        g.node[2].input[0] = "a_int_float"
        g.node.insert(2, helper.make_node("Cast", ["a"], ["a_int"], to=TensorProto.INT64))
        g.node.insert(3, helper.make_node("Cast", ["a_int"], ["a_int_float"], to=TensorProto.FLOAT))
    elif kind == "order":
        g.node.insert(0, g.node.pop())


def _float64_forward(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph without its Gradient node, in float64 (outputs: y), for finite differences."""
    forward = onnx.ModelProto()
    forward.CopyFrom(model)
    g = forward.graph
    kept = [n for n in g.node if not (n.domain == TRAINING)]
    del g.node[:]
    g.node.extend(kept)
    for vi in (*g.input, *g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
    del g.output[:]
    return forward


def _forward_loads(model: onnx.ModelProto) -> bool:
    """Whether plain onnxruntime loads the graph without its Gradient node (outputs: y)."""
    import onnxruntime

    forward = onnx.ModelProto()
    forward.CopyFrom(model)
    kept = [n for n in forward.graph.node if n.domain != TRAINING]
    del forward.graph.node[:]
    forward.graph.node.extend(kept)
    produced = {o for n in kept for o in n.output} | {i.name for i in forward.graph.input}
    outputs = [o for o in forward.graph.output if o.name in produced]
    del forward.graph.output[:]
    forward.graph.output.extend(outputs or [helper.make_tensor_value_info(kept[-1].output[0], 0, None)])
    forward.ir_version = 8
    try:
        onnxruntime.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
        return True
    except Exception:  # noqa: BLE001
        return False


def _finite_differences(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    grad = model.graph.node[-1] if model.graph.node[-1].domain == TRAINING else \
        next(n for n in model.graph.node if n.domain == TRAINING)
    attrs = {a.name: helper.get_attribute_value(a) for a in grad.attribute}
    xs = [x.decode() for x in attrs["xs"]]
    zs = [z.decode() for z in attrs.get("zs", [])]
    if len(grad.input) != len(xs) + len(zs):
        raise ValueError("the Gradient node's inputs are not one per xs and zs")
    y = attrs["y"].decode()
    forward = _float64_forward(model)
    forward.graph.output.append(helper.make_tensor_value_info(y, TensorProto.DOUBLE, None))
    known = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in feeds.items()}
    known.update({t.name: numpy_helper.to_array(t) for t in forward.graph.initializer})
    values = dict(known)
    values.update({name: known[value] for name, value in zip(xs + zs, grad.input)})  # the node's inputs
    # xs (graph inputs or initializers) become inputs of the probe so they can be perturbed
    inits = [t for t in forward.graph.initializer if t.name not in xs]
    del forward.graph.initializer[:]
    forward.graph.initializer.extend(inits)
    declared = {vi.name for vi in forward.graph.input}
    for name in xs:
        if name not in declared:
            forward.graph.input.append(helper.make_tensor_value_info(name, TensorProto.DOUBLE, None))
    evaluator = ReferenceEvaluator(forward)
    probe_names = [vi.name for vi in forward.graph.input]

    def f(v):
        return float(np.sum(evaluator.run(None, {k: v[k] for k in probe_names})[0]))

    eps, result = 1e-5, []
    for name in xs:
        base = values[name]
        d = np.zeros_like(base, dtype=np.float64)
        for idx in np.ndindex(base.shape):
            plus, minus = dict(values), dict(values)
            plus[name] = base.copy()
            plus[name][idx] += eps
            minus[name] = base.copy()
            minus[name][idx] -= eps
            d[idx] = (f(plus) - f(minus)) / (2 * eps)
        result.append(d)
    return result


def gradient_case(ctx, rng: np.random.Generator, i: int) -> Outcome:
    model = _gradient_model()
    kinds = [] if i % 5 == 0 else [_mutate_gradient(model, rng) for _ in range(int(rng.integers(1, 3)))]
    kind = "+".join(kinds) or "none"
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        feeds[vi.name] = rng.uniform(-1, 1, [d.dim_value for d in tt.shape.dim]).astype(dtype)
    stage = "load"
    try:
        session = ot.InferenceSession(model)
        stage = "run"
        got = session.run(None, feeds)
    except CLEAN as error:
        return ("clean" if _clean(error) else "wrong"), kind, str(error)
    except ORT_INPUT_ERRORS as error:
        mine = stage == "load" and _forward_loads(model)  # else onnxruntime rejects the user's graph
        return ("wrong" if mine or not _clean(error) else "clean"), kind, f"{stage}: {error}"
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"raw {type(error).__name__}: {error}"
    names = [o.name for o in model.graph.output]
    try:
        want = _finite_differences(model, feeds)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"ran although the reference refuses it: {type(error).__name__}: {error}"
    grad_node = next(n for n in model.graph.node if n.domain == TRAINING)
    got_grads = [got[names.index(o)] for o in grad_node.output]
    want = want[:len(got_grads)]  # fewer outputs than xs: the first gradients only
    if _close(got_grads, want, rtol=2e-3, atol=2e-4):
        return "ran", kind, ""
    return "wrong", kind, "gradient differs from float64 finite differences"


# ------------------------------------------------------------------ training feeds
def _training_sessions():
    model = ot.build_training_model(make_mlp((16, 8, 4), seed=1), "cross_entropy", ot.Adam())
    return ot.TrainingSession(model), ot.TrainingSession(model)


# (kind, valid): valid variants must give the canonical feed's step bit for bit
FEED_KINDS = [("big_endian", True), ("fortran", True), ("strided", True), ("labels_big_endian", True),
              ("lr", True), ("dtype", False), ("shape", False), ("nan", False), ("inf", False),
              ("missing", False), ("extra", False), ("list", False), ("empty", False),
              ("labels_float", False), ("labels_out_of_range", False), ("labels_rows", False),
              ("scalar", False), ("none", False), ("string", False), ("bad_lr", False),
              ("lr_feed", True), ("bad_lr_feed", False)]


def _training_feed(kind: str, batch: dict, rng: np.random.Generator):
    """(feeds, lr) for one kind of feed."""
    if kind in _INPUT_KINDS:
        return _input_feed(kind, batch, rng), None
    return _other_feed(kind, batch, rng)


_INPUT_KINDS = ("big_endian", "fortran", "strided", "dtype", "shape", "nan", "inf", "scalar", "none", "string")


def _input_feed(kind: str, batch: dict, rng: np.random.Generator) -> dict:
    """The feeds with the ``input`` array changed (``kind``)."""
    x = batch["input"]
    if kind == "big_endian":
        return dict(batch, input=x.astype(">f4"))
    if kind == "fortran":
        return dict(batch, input=np.asfortranarray(x))
    if kind == "strided":
        wide = np.zeros((x.shape[0], x.shape[1] * 2), np.float32)
        wide[:, ::2] = x
        return dict(batch, input=wide[:, ::2])
    if kind == "dtype":
        return dict(batch, input=x.astype(rng.choice([np.float64, np.float16, np.int32])))
    if kind == "shape":
        return dict(batch, input=x[:, :int(rng.integers(1, 16))])
    if kind in ("nan", "inf"):
        bad = x.copy()
        bad[int(rng.integers(x.shape[0])), int(rng.integers(x.shape[1]))] = np.nan if kind == "nan" else np.inf
        return dict(batch, input=bad)
    if kind == "scalar":
        return dict(batch, input=np.float32(1.0))
    if kind == "none":
        return dict(batch, input=None)
    return dict(batch, input="0.5")  # "string"


def _other_feed(kind: str, batch: dict, rng: np.random.Generator):
    """(feeds, lr) for the labels, the feed names and container, and the learning rate."""
    x, y = batch["input"], batch["labels"]
    lr = None
    if kind == "labels_big_endian":
        return dict(batch, labels=y.astype(">i8")), lr
    if kind == "lr":
        return batch, float(rng.choice([0.0, 1e-4, 0.5]))
    if kind == "missing":
        dropped = str(rng.choice(sorted(batch)))
        return {k: v for k, v in batch.items() if k != dropped}, lr
    if kind == "extra":
        return dict(batch, surprise=x), lr
    if kind == "list":
        return [x, y], lr
    if kind == "empty":
        return dict(batch, input=x[:0], labels=y[:0]), lr
    if kind == "labels_float":
        return dict(batch, labels=y.astype(np.float32)), lr
    if kind == "labels_out_of_range":
        bad = y.copy()
        bad[int(rng.integers(len(y)))] = int(rng.choice([-1, 4, 99, -101]))
        return dict(batch, labels=bad), lr
    if kind == "labels_rows":
        return dict(batch, labels=y[:-1]), lr
    if kind == "lr_feed":  # the twin gets the same rate as step(lr=...)
        rate = float(rng.choice([0.0, 1e-3, 0.5]))
        return dict(batch, learning_rate=np.array(rate, np.float32)), rate
    if kind == "bad_lr_feed":
        rate = [np.nan, -1.0, np.inf][int(rng.integers(3))]
        return dict(batch, learning_rate=np.array(rate, np.float32)), lr
    bad_rates = [-1.0, np.nan, np.inf, "0.01", np.array([0.1, 0.2]), True, None]
    return batch, bad_rates[int(rng.integers(len(bad_rates) - 1))]


def training_feed_case(ctx, rng: np.random.Generator, i: int) -> Outcome:
    if "sessions" not in ctx:
        ctx["sessions"] = _training_sessions()
    session, twin = ctx["sessions"]
    batch = {"input": rng.standard_normal((6, 16)).astype(np.float32),
             "labels": rng.integers(0, 4, 6).astype(np.int64)}
    kind, valid = FEED_KINDS[int(rng.integers(len(FEED_KINDS)))]
    feeds, lr = _training_feed(kind, batch, rng)
    before = session.state_dict()
    try:
        loss = session.step(feeds, lr=None if kind == "lr_feed" else lr)["loss"]
    except CLEAN as error:
        changed = [k for k, v in session.state_dict().items()
                   if not np.array_equal(v, before[k], equal_nan=True)]
        if changed:
            return "wrong", kind, f"failed step changed {changed[:3]}"
        return ("wrong" if valid or not _clean(error) else "clean"), kind, str(error)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"raw {type(error).__name__}: {error}"
    if not valid:
        return "wrong", kind, "accepted"
    twin.load_state_dict(before)
    want = twin.step(batch, lr=lr)["loss"]
    same = np.array_equal(loss, want) and all(
        np.array_equal(v, twin.state_dict()[k]) for k, v in session.state_dict().items())
    return ("ran", kind, "") if same else ("wrong", kind, "differs from the canonical feed's step")


# ------------------------------------------------------------------ inference feeds
INFERENCE_KINDS = [("big_endian", True), ("fortran", True), ("strided", True), ("nan", True),
                   ("r_shape_1", True), ("dtype", False), ("shape", False), ("missing", False),
                   ("extra", False), ("list", False), ("r_shape_2", False), ("t_float", False),
                   ("none", False)]


def _inference_feeds(kind: str, good: dict, name: str) -> tuple:
    """(feeds, the feeds onnx.reference gets) for one kind of feed, ``name`` the input it changes."""
    feeds = dict(good)
    if kind == "big_endian":
        feeds = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in good.items()}
    elif kind == "fortran":
        feeds[name] = np.asfortranarray(good[name].T).T if good[name].ndim == 2 else good[name]
    elif kind == "strided":
        wide = np.repeat(good[name], 2).reshape(*good[name].shape, 2)
        feeds[name] = wide[..., 0]
    elif kind == "nan":
        feeds[name] = good[name].copy()
        feeds[name].reshape(-1)[0] = np.nan
        good = feeds
    elif kind == "r_shape_1":
        feeds["R"] = good["R"].reshape(1)
    elif kind == "dtype":
        feeds[name] = good[name].astype(np.float64)
    elif kind == "shape":
        feeds[name] = np.ones(5, np.float32)
    elif kind == "missing":
        del feeds[name]
    elif kind == "extra":
        feeds["surprise"] = good[name]
    elif kind == "list":
        feeds = list(good.values())
    elif kind == "r_shape_2":
        feeds["R"] = np.array([0.1, 0.2], np.float32)
    elif kind == "t_float":
        feeds["T"] = np.array(1.0, np.float32)
    elif kind == "none":
        feeds[name] = None
    return feeds, good


def inference_feed_case(ctx, rng: np.random.Generator, i: int) -> Outcome:
    op = OPS[i % 3]
    key = f"session_{op}"
    if key not in ctx:
        model = optimizer_model(op, n=2, shapes=[[3], [2, 2]], r_shape=None)
        ctx[key] = (model, ot.InferenceSession(model), ReferenceEvaluator(model))
    model, session, reference = ctx[key]
    good = _feeds_for(model.graph, rng)
    good["R"], good["T"] = np.array(0.1, np.float32), np.array(int(rng.integers(0, 4)), np.int64)
    kind, valid = INFERENCE_KINDS[int(rng.integers(len(INFERENCE_KINDS)))]
    name = str(rng.choice([n for n in good if n not in ("R", "T")]))
    feeds, good = _inference_feeds(kind, good, name)
    try:
        got = session.run(None, feeds)
    except CLEAN + ORT_INPUT_ERRORS as error:
        return ("wrong" if valid or not _clean(error) else "clean"), kind, str(error)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"raw {type(error).__name__}: {error}"
    if not valid:
        return "wrong", kind, "accepted"
    want = reference.run(None, {k: np.ascontiguousarray(v).astype(v.dtype.newbyteorder("="))
                                for k, v in good.items()})
    return ("ran", kind, "") if _close(got, want) else ("wrong", kind, "differs from onnx.reference")


# ------------------------------------------------------------------ checkpoint bytes
def _saved_checkpoint(ctx) -> None:
    session = ot.TrainingSession(ot.build_training_model(make_mlp((16, 8, 4), seed=1),
                                                         "cross_entropy", ot.Adam()))
    rng = np.random.default_rng(0)
    session.step({"input": rng.standard_normal((6, 16)).astype(np.float32),
                  "labels": rng.integers(0, 4, 6).astype(np.int64)})
    ctx["dir"] = tempfile.mkdtemp(prefix="fuzz_ckpt_")
    path = os.path.join(ctx["dir"], "ckpt.onnx")
    session.save(path)
    ctx["data"] = open(path, "rb").read()
    ctx["want"] = session.state_dict()


def checkpoint_case(ctx, rng: np.random.Generator, i: int) -> Outcome:
    if "data" not in ctx:
        _saved_checkpoint(ctx)
    data, want = ctx["data"], ctx["want"]
    kind = ("truncate", "flip", "garbage", "zero", "splice", "append", "duplicate")[i % 7]
    damaged = bytearray(data)
    if kind == "truncate":
        damaged = damaged[:int(rng.integers(0, len(data)))]
    elif kind == "flip":
        for _ in range(int(rng.integers(1, 4))):
            damaged[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    elif kind == "garbage":
        damaged = bytearray(rng.integers(0, 256, int(rng.integers(1, 4096)), dtype=np.uint8))
    elif kind == "zero":
        start = int(rng.integers(len(data)))
        damaged[start:start + 64] = bytes(min(64, len(data) - start))
    elif kind == "splice":
        start = int(rng.integers(len(data) // 2))
        damaged = damaged[:start] + damaged[start + int(rng.integers(1, 64)):]
    elif kind == "append":
        damaged += bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))
    else:
        start, size = int(rng.integers(len(data) // 2)), int(rng.integers(8, 256))
        damaged = damaged[:start] + damaged[start:start + size] + damaged[start:]
    target = os.path.join(ctx["dir"], f"bad{i}.onnx")
    with open(target, "wb") as f:
        f.write(bytes(damaged))
    try:
        loaded = ot.TrainingSession(target).state_dict()
    except CLEAN as error:
        return ("clean" if _clean(error) else "wrong"), kind, str(error)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"raw {type(error).__name__}: {error}"
    finally:
        os.unlink(target)
    if set(loaded) == set(want) and all(np.array_equal(loaded[k], want[k]) for k in want):
        return "ran", kind, ""  # the damage hit nothing that matters (same values)
    return "wrong", kind, "loaded with different values"


# ------------------------------------------------------------------ training models
ADAM_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "norm_coefficient": 0.0,
                 "norm_coefficient_post": 0.0}


def _mutate_training_model(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    info = model.training_info[0]
    algorithm = info.algorithm
    adam = next(n for n in algorithm.node if n.op_type == "Adam")
    inits = {t.name: t for t in algorithm.initializer}
    kind = str(rng.choice(["attr_value", "attr_unknown", "attr_type", "drop_input", "extra_input",
                           "state_dtype", "state_shape", "binding_value", "binding_key",
                           "gradient_xs", "lr_value", "t_dtype"]))
    if kind == "attr_value":
        name = str(rng.choice(sorted(ADAM_DEFAULTS)))
        _set_attr(adam, helper.make_attribute(name, float(rng.choice(
            [np.nan, np.inf, -1.0, 0.0, 0.5, 0.99, 1.0, 2.0]))))
    elif kind == "attr_unknown":
        adam.attribute.append(helper.make_attribute("surprise", 1.0))
    elif kind == "attr_type":
        _set_attr(adam, helper.make_attribute(str(rng.choice(sorted(ADAM_DEFAULTS))), "text"))
    elif kind == "drop_input":
        del adam.input[int(rng.integers(len(adam.input)))]
    elif kind == "extra_input":
        adam.input.append(adam.input[-1])
    elif kind in ("state_dtype", "state_shape"):
        name = str(rng.choice(["W0.V", "b1.H"]))
        value = numpy_helper.to_array(inits[name])
        value = value.astype(np.float64) if kind == "state_dtype" else value.reshape(-1, 1)
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    elif kind == "binding_value":
        info.update_binding[int(rng.integers(len(info.update_binding)))].value = "nowhere"
    elif kind == "binding_key":
        info.update_binding.add(key="nope", value="W0.new")
    elif kind == "gradient_xs":
        grad = next(n for n in algorithm.node if n.op_type == "Gradient")
        _set_attr(grad, helper.make_attribute("xs", ["W0", "b0", "W1"]))
        del grad.input[3:]
        del grad.output[3:]
    elif kind == "lr_value":
        inits["learning_rate"].CopyFrom(numpy_helper.from_array(
            np.array(rng.choice([np.nan, -1.0, 0.5]), np.float32), "learning_rate"))
    elif kind == "t_dtype":
        inits["optimizer.T"].CopyFrom(numpy_helper.from_array(np.array(0, np.int32), "optimizer.T"))
    return kind


def _reference_adam_step(model: onnx.ModelProto, batch: dict) -> tuple[float, dict]:
    """One step by the spec: the loss of main graph + loss nodes in float64 (onnx.reference),
    its gradient by central differences, then Adam's pseudo-code with the node's attributes."""
    info = model.training_info[0]
    algorithm = info.algorithm
    adam = next(n for n in algorithm.node if n.op_type == "Adam")
    grad = next(n for n in algorithm.node if n.op_type == "Gradient")
    xs = [x.decode() for x in helper.get_attribute_value(next(a for a in grad.attribute if a.name == "xs"))]
    attrs = dict(ADAM_DEFAULTS, **{a.name: a.f for a in adam.attribute if a.name in ADAM_DEFAULTS})
    state = {t.name: numpy_helper.to_array(t) for t in (*model.graph.initializer, *algorithm.initializer)}
    loss_nodes = [n for n in algorithm.node if n.op_type in ("SoftmaxCrossEntropyLoss", "Identity")]
    graph = helper.make_graph(
        list(model.graph.node) + loss_nodes, "loss",
        [helper.make_tensor_value_info("input", TensorProto.DOUBLE, None),
         helper.make_tensor_value_info("labels", TensorProto.INT64, None)]
        + [helper.make_tensor_value_info(x, TensorProto.DOUBLE, None) for x in xs],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, None)],
        [numpy_helper.from_array(v.astype(np.float64), k) for k, v in state.items()
         if k in {i for n in model.graph.node for i in n.input} and k not in xs])
    evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=list(model.opset_import)))
    values = {"input": batch["input"].astype(np.float64), "labels": batch["labels"],
              **{x: state[x].astype(np.float64) for x in xs}}

    def loss(v):
        return float(evaluator.run(None, v)[0])

    r = float(state["learning_rate"])
    t = int(state["optimizer.T"]) + 1
    n = len(xs)
    new = {}
    for i, x in enumerate(xs):
        g = np.zeros_like(values[x])
        for idx in np.ndindex(g.shape):
            plus, minus = dict(values), dict(values)
            plus[x], minus[x] = values[x].copy(), values[x].copy()
            plus[x][idx] += 1e-6
            minus[x][idx] -= 1e-6
            g[idx] = (loss(plus) - loss(minus)) / 2e-6
        v_name, h_name = adam.input[2 + 2 * n + i], adam.input[2 + 3 * n + i]
        v, h, xv = state[v_name].astype(np.float64), state[h_name].astype(np.float64), values[x]
        with np.errstate(all="ignore"):
            g_reg = attrs["norm_coefficient"] * xv + g
            v_new = attrs["alpha"] * v + (1 - attrs["alpha"]) * g_reg
            h_new = attrs["beta"] * h + (1 - attrs["beta"]) * g_reg * g_reg
            rate = r * np.sqrt(1 - attrs["beta"] ** t) / (1 - attrs["alpha"] ** t) if t > 0 else r
            x_new = (1 - attrs["norm_coefficient_post"]) * (xv - rate * v_new / (np.sqrt(h_new) + attrs["epsilon"]))
        new.update({x: x_new, v_name: v_new, h_name: h_new})
    return loss(values), new


def training_model_case(ctx, rng: np.random.Generator, i: int) -> Outcome:
    model = ot.build_training_model(make_mlp((4, 3, 2), seed=1), "cross_entropy", ot.Adam(lr=0.1))
    kind = "none" if i % 4 == 0 else _mutate_training_model(model, rng)
    batch = {"input": rng.standard_normal((5, 4)).astype(np.float32),
             "labels": rng.integers(0, 2, 5).astype(np.int64)}
    session = None
    try:
        session = ot.TrainingSession(model, fast=bool(i % 2))
        before = session.state_dict()
        loss = float(session.step(batch)["loss"])
    except CLEAN as error:
        if session is not None and any(not np.array_equal(v, before[k], equal_nan=True)
                                       for k, v in session.state_dict().items()):
            return "wrong", kind, f"failed step changed the state: {error}"
        return ("clean" if _clean(error) else "wrong"), kind, str(error)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"raw {type(error).__name__}: {error}"
    try:
        want_loss, want = _reference_adam_step(model, batch)
    except Exception as error:  # noqa: BLE001
        return "wrong", kind, f"ran although the reference refuses it: {type(error).__name__}: {error}"
    got = session.state_dict()
    if np.isclose(loss, want_loss, rtol=1e-5) and all(
            np.allclose(got[k], v, rtol=2e-3, atol=1e-5, equal_nan=True) for k, v in want.items()):
        return "ran", kind, ""
    off = [k for k, v in want.items() if not np.allclose(got[k], v, rtol=2e-3, atol=1e-5, equal_nan=True)]
    return "wrong", kind, f"differs from the spec's step (loss {loss} vs {want_loss}; {off[:3]})"


CATEGORIES: dict[str, Callable[[dict, np.random.Generator, int], Outcome]] = {
    "graphs": graph_case,
    "gradients": gradient_case,
    "training_feeds": training_feed_case,
    "inference_feeds": inference_feed_case,
    "checkpoints": checkpoint_case,
    "training_models": training_model_case,
}


def main(category: str, seed: int, start: int, stop: int) -> None:
    import logging
    logging.disable(logging.CRITICAL)  # failing kernels also log; the outcome line says it all
    case, ctx = CATEGORIES[category], {}
    for i in range(start, stop):
        outcome, kind, detail = case(ctx, np.random.default_rng([seed, i]), i)
        print(json.dumps({"i": i, "outcome": outcome, "kind": kind, "detail": detail[:300]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
