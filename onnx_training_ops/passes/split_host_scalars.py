"""Pass: the step-dependent scalars leave the graph for a host program.

What depends only on the update count ``T`` and the learning rates (the bias corrections
``sqrt(1 - beta2^T) / (1 - beta1^T)``, computed in float64; ``T + 1``, int64) is a handful of
scalar ops. On a GPU they are the wrong place: onnxruntime-web's WebGPU build runs no float64
op at all and its int64 arithmetic is 32-bit. This pass moves that cone (every node with an
input in it whose inputs are all in it or constants) out of the model into a **host
program**: a list of scalar nodes in plain data that the trainer evaluates in float64 on the
CPU each step (``T`` stays a host number, exact to 2^53). The scalars the remaining graph
reads from the cone become graph inputs; the cone's graph outputs (``T``'s update) become the
program's outputs.

The program (JSON-ready)::

    {"inputs": [name...], "constants": {name: {"dtype", "shape", "values"}},
     "nodes": [{"op", "inputs", "outputs", "attrs"}], "outputs": [name...],
     "feeds": [{"name", "dtype", "shape"}]}   # what the graph now reads from it
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, helper

from ..errors import TrainingOpError, node_label
from ._rewrite import constants

HOST_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Max", "Min", "Neg", "Abs", "Exp", "Log",
                      "Reciprocal", "Floor", "Ceil", "Greater", "Less", "GreaterOrEqual", "LessOrEqual",
                      "Equal", "Not", "And", "Or", "Where", "Cast", "Identity"})


def _types(model: ModelProto) -> dict[str, onnx.TypeProto]:
    g = onnx.shape_inference.infer_shapes(model).graph
    return {vi.name: vi.type for vi in (*g.input, *g.output, *g.value_info)}


def _dtype(tp: onnx.TypeProto | None) -> str:
    if tp is None:
        return "unknown"
    return helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type).name


def _shape(tp: onnx.TypeProto | None) -> list[int] | None:
    if tp is None or not tp.tensor_type.HasField("shape"):
        return None
    dims = tp.tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def split_host_scalars(model: ModelProto, roots: Iterable[str]) -> tuple[ModelProto, dict[str, Any]]:
    """Move the scalar cone of ``roots`` (graph inputs) out of ``model`` (in place).

    Args:
        model: the step model.
        roots: the graph inputs computed on the host (the update count, the learning rates).

    Returns:
        ``(model, program)``: the rewritten model and the host program (module docstring).

    Raises:
        TrainingOpError: a node of the cone that the host program does not evaluate, or a
            value of the cone that is not a scalar (one element).
    """
    graph = model.graph
    types = _types(model)
    known = constants(graph)
    roots = [r for r in roots if r in {vi.name for vi in graph.input}]
    host = set(roots)
    cone, rest = [], []
    for node in graph.node:
        ins = [i for i in node.input if i]
        if node.op_type != "Constant" and any(i in host for i in ins) and all(i in host or i in known for i in ins):
            cone.append(node)
            host.update(o for o in node.output if o)
        else:
            rest.append(node)
    for node in cone:
        if node.op_type not in HOST_OPS or node.domain not in ("", "ai.onnx"):
            raise TrainingOpError(f"split_host_scalars: {node_label(node)} depends only on {', '.join(roots)}, but "
                                  f"the host program does not evaluate {node.op_type}")
        for name in node.output:
            shape = _shape(types.get(name))
            if shape is None or int(np.prod(shape)) != 1:
                raise TrainingOpError(f"split_host_scalars: {node_label(node)} output {name!r} has shape {shape}; "
                                      "the host program computes scalars (one element) only")
    read_by_rest = {i for n in rest for i in n.input}
    used_constants = {i for n in cone for i in n.input if i in known and i not in host}
    program: dict[str, Any] = {  # the JSON document the host runs
        "inputs": roots,
        "constants": {name: {"dtype": known[name].dtype.name, "shape": list(known[name].shape),
                             "values": known[name].reshape(-1).tolist()} for name in sorted(used_constants)},
        "nodes": [{"op": n.op_type, "inputs": list(n.input), "outputs": list(n.output),
                   "attrs": {a.name: helper.get_attribute_value(a) for a in n.attribute}} for n in cone],
        "outputs": [o.name for o in graph.output if o.name in host],
        "feeds": [],
    }
    for node in program["nodes"]:
        for key, value in node["attrs"].items():
            if not isinstance(value, (int, float, str, list)):
                raise TrainingOpError(f"split_host_scalars: node {node['op']} attribute {key!r} is not a number")
    fed = sorted(name for name in host if name in read_by_rest and name not in roots)
    for name in fed:
        program["feeds"].append({"name": name, "dtype": _dtype(types.get(name)), "shape": _shape(types.get(name))})
        graph.input.append(helper.make_value_info(name, types[name]))
    kept_outputs = [o for o in graph.output if o.name not in host]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    del graph.node[:]
    graph.node.extend(rest)
    still_read = {i for n in rest for i in n.input} | {o.name for o in graph.output}
    kept_inputs = [vi for vi in graph.input if vi.name not in roots or vi.name in still_read]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    return model, program
