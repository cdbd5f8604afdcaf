"""Helpers for the Gradient tests: build a model around a few nodes, expand, run, compare."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_training_ops.passes.expand_gradient import expand_gradient
from onnx_training_ops.passes.lower_recurrent import lower_recurrent
from onnx_training_ops.passes.split_sequences import split_sequences

DOMAIN = "ai.onnx.preview.training"


def value_info(name: str, array: np.ndarray, dynamic: bool = False) -> onnx.ValueInfoProto:
    dims = [f"{name}_d{i}" for i in range(array.ndim)] if dynamic else list(array.shape)
    return helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def gradient_model(nodes: Sequence[onnx.NodeProto], inputs: Mapping[str, np.ndarray], y: str,
                   xs: Sequence[str], zs: Sequence[str] = (), opset: int = 18,
                   initializers: Mapping[str, np.ndarray] | None = None, dynamic: bool = False,
                   grad_inputs: Sequence[str] | None = None, name: str = "grad") -> onnx.ModelProto:
    """A model: graph inputs ``inputs``, forward ``nodes``, and a Gradient node (named
    ``name``) whose outputs ``d_<x>`` are graph outputs along with ``y``."""
    grad = helper.make_node("Gradient", list(grad_inputs or list(xs) + list(zs)),
                            [f"d_{x}" for x in xs], name=name, domain=DOMAIN,
                            xs=list(xs), y=y, **({"zs": list(zs)} if zs else {}))
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()]
    graph = helper.make_graph(
        list(nodes) + [grad], "g",
        [value_info(k, v, dynamic) for k, v in inputs.items()],
        [onnx.ValueInfoProto(name=y)] + [onnx.ValueInfoProto(name=f"d_{x}") for x in xs],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model


def runnable(model: onnx.ModelProto) -> onnx.ModelProto:
    """Expanded copy (after the passes prepare runs before expand_gradient) with an IR
    version onnxruntime 1.31 reads."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    expanded = expand_gradient(lower_recurrent(split_sequences(copy)))
    expanded.ir_version = min(expanded.ir_version, 10)
    return expanded


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_expanded(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Expand, check (onnx.checker with strict shape inference) and run in onnxruntime."""
    expanded = runnable(model)
    inferred = onnx.shape_inference.infer_shapes(expanded)
    known = {v.name: v for v in inferred.graph.value_info}
    for out in expanded.graph.output:  # the test declares y untyped
        if not out.HasField("type") and out.name in known:
            out.CopyFrom(known[out.name])
    if all(o.type.tensor_type.HasField("shape") for o in expanded.graph.output):
        onnx.checker.check_model(expanded, full_check=True)
    names = [o.name for o in expanded.graph.output]
    return dict(zip(names, session(expanded).run(names, dict(feeds))))


def forward_fn(nodes, inputs: Mapping[str, np.ndarray], y: str, opset: int,
               initializers=None, reference: bool = False):
    """f(feeds) -> sum(y) in float64, by onnxruntime (or onnx.reference for float64 Conv)."""
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()]
    graph = helper.make_graph(list(nodes), "f", [value_info(k, v) for k, v in inputs.items()],
                              [onnx.ValueInfoProto(name=y)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if reference:
        ev = ReferenceEvaluator(model)
        return lambda feeds: float(np.sum(ev.run(None, dict(feeds))[0], dtype=np.float64))
    model = onnx.shape_inference.infer_shapes(model)
    model.graph.output[0].CopyFrom(
        next((v for v in model.graph.value_info if v.name == y), model.graph.output[0]))
    sess = session(model)
    return lambda feeds: float(np.sum(sess.run([y], dict(feeds))[0], dtype=np.float64))


def finite_difference(f, feeds: Mapping[str, np.ndarray], x: str, eps: float,
                      max_elements: int = 60, rng: np.random.Generator | None = None):
    """Central differences of f wrt feeds[x] at (a sample of) its elements -> (flat idx, values)."""
    base = {k: np.array(v, copy=True) for k, v in feeds.items()}
    flat = base[x].reshape(-1)
    n = flat.size
    idx = np.arange(n)
    if n > max_elements:
        idx = np.sort((rng or np.random.default_rng(0)).choice(n, max_elements, replace=False))
    out = np.empty(len(idx))
    for j, i in enumerate(idx):
        orig = flat[i]
        flat[i] = orig + eps
        plus = f(base)
        flat[i] = orig - eps
        minus = f(base)
        flat[i] = orig
        out[j] = (plus - minus) / (2 * eps)
    return idx, out


def check_gradient(nodes, inputs: Mapping[str, np.ndarray], y: str, xs: Sequence[str],
                   opset: int = 18, initializers=None, dynamic: bool = False,
                   eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-7,
                   reference_fd: bool = False, analytic_dtype=None) -> dict[str, np.ndarray]:
    """Assert the expanded Gradient of ``sum(y)`` wrt ``xs`` matches float64 central differences.

    ``analytic_dtype=np.float32`` runs the expanded model in float32 (for ops onnxruntime has
    no float64 kernel for) while the differences are taken in float64 (``reference_fd``: by
    onnx.reference).
    """
    analytic_inputs, analytic_inits = dict(inputs), dict(initializers or {})
    if analytic_dtype is not None:
        analytic_inputs = {k: v.astype(analytic_dtype) if v.dtype.kind == "f" else v
                           for k, v in inputs.items()}
        analytic_inits = {k: np.asarray(v).astype(analytic_dtype)
                          if np.asarray(v).dtype.kind == "f" else v
                          for k, v in analytic_inits.items()}
    model = gradient_model(nodes, analytic_inputs, y, xs, opset=opset,
                           initializers=analytic_inits, dynamic=dynamic)
    got = run_expanded(model, analytic_inputs)
    f = forward_fn(nodes, inputs, y, opset, initializers, reference=reference_fd)
    for x in xs:
        g = got[f"d_{x}"]
        assert g.shape == inputs[x].shape, (x, g.shape, inputs[x].shape)
        idx, fd = finite_difference(f, inputs, x, eps)
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=rtol, atol=atol,
                                   err_msg=f"gradient wrt {x}")
    return got
