"""Pass (portable form): lower every Adam, Momentum and Adagrad node to standard ONNX ops.

After ``expand_gradient`` and this pass a model holds no node of ai.onnx.preview.training,
so it runs in any onnxruntime build (C, C++, C#, Java, JavaScript...) with nothing
registered, and in ``onnx.reference.ReferenceEvaluator``.

Each optimizer's chain is written by its own module (``lower`` in
:mod:`onnx_training_ops.optim.adam`, ``.momentum``, ``.adagrad``; the shared pieces in
:mod:`onnx_training_ops.optim._lowering`); this pass walks the graphs, types the inputs and
renames the results to the node's outputs. The graph computes what the reference kernels
compute, in the same operation order, so float32 results agree to the last bit except where
libm's ``pow`` differs between processes:

* scalars — R, T, the bias correction ``R·sqrt(1-beta^T)/(1-alpha^T)`` for T > 0, Momentum's
  ``beta`` (1 on the first step), Adagrad's ``R/(1+T·decay_factor)`` — in float64 (as the
  kernels' Python floats), then one Cast to the tensors' dtype;
* attribute constants (``alpha``, ``1-alpha``, ...) are folded here, in float64 from the
  float32 values the model holds and then rounded to the tensors' dtype, as numpy does with
  a Python float times a float32 array;
* tensor math in the tensors' dtype, one elementwise op per step of the pseudo code, with
  numpy broadcasting (onnx's multidirectional broadcasting is the same rule).

Identities are not emitted: ``(1 - norm_coefficient_post) * X`` when it is 0 (exact), Adagrad's
``R / (1 + T·0)`` (exact) and ``norm_coefficient * X + G`` when ``norm_coefficient`` is 0 and G has
X's static shape (equal to the spec for every finite X; an infinite or NaN X would make the
spec's ``0·X`` NaN and poison V/H, which the portable form does not reproduce).

Each tensor's chain is a line of elementwise ops whose intermediates have one consumer, so
onnxruntime's allocation planner reuses their buffers in place; scalar subgraphs over
constants fold at session creation; the per-node scalars are shared by its tensors.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, helper

from ..errors import TrainingOpError, node_label
from ..optim._lowering import FLOAT_TYPES, Emitter, LoweredTensor, NodeScalars
from ..optim.registry import LOWERINGS
from ..schema import DOMAIN, OPTIMIZERS
from ..walk import all_graphs, model_graphs
from ._graph import ValueType, all_names, concatenated, rename_values, unique_name, value_types
from .encode_exact_attributes import node_attributes

MIN_OPSET = 9  # Where (and Greater on double)
DEFAULT_OPSET = 13  # imported when the model imports no ai.onnx opset (the conformance cases)
CASTLIKE_OPSET = 15  # for X of unknown dtype


def _lower_node(e: Emitter, node: onnx.NodeProto, types: dict[str, ValueType], label: str) -> None:
    """Emit ``node``'s update as standard ops: its scalars once, then each tensor's chain
    (the optimizer's ``lower``, :data:`onnx_training_ops.optim.registry.LOWERINGS`)."""
    spec = OPTIMIZERS[node.op_type]
    n = spec.n_tensors(len(node.input))
    if n is None:
        raise TrainingOpError(f"{label}: expected R, T and {spec.n_groups_in}*N tensors "
                              f"({', '.join(spec.tensor_inputs)} per tensor), found {len(node.input)} inputs")
    a = _attributes(node, spec, label)
    base = node.name or node.output[0] or node.op_type
    s = NodeScalars(e, node, types, base)
    tensor_update = LOWERINGS[node.op_type](s, a, label)
    finals: dict[str, str] = {}  # emitted value -> the node's output name
    for i in range(n):
        x, g, *state = [node.input[2 + j * n + i] for j in range(spec.n_groups_in)]
        outputs = [node.output[j * n + i] if j * n + i < len(node.output) else "" for j in range(spec.n_groups_out)]
        dtype = _dtype(x, [x, g, *state], spec.tensor_inputs, types, e.opset, f"{label}: tensor {i}")
        xt, gt = types.get(x), types.get(g)
        same = (xt is not None and gt is not None and xt.shape is not None and xt.shape == gt.shape
                and all(d is not None for d in xt.shape))
        values = tensor_update(LoweredTensor(e, s, x, g, tuple(state), dtype, f"{base}/{i}", same))
        for value, out in zip(values, outputs):
            if out:
                finals[value] = out
    rename_values(e.nodes, finals)


def _attributes(node: onnx.NodeProto, spec, label: str) -> dict:
    """The node's attributes, every one present, floats as the float32 values a model holds."""
    a = node_attributes(node)
    missing = [k for k in spec.all_attribute_names() if k not in a]
    if missing:
        raise TrainingOpError(f"{label}: attribute(s) {', '.join(missing)} missing (run fill_default_attributes first)")
    for k in spec.float_attributes:
        a[k] = float(np.float32(a[k]))  # what a model holds, as the kernels read it
    return a


def _dtype(x: str, group: list[str], roles, types: dict[str, ValueType], opset: int, where: str):
    """The group's element type (TensorProto enum), or X's name when it is not known statically."""
    known = {}
    for name, role in zip(group, roles):
        vt = types.get(name)
        if vt is None or not vt.elem_type:
            continue
        if vt.elem_type not in FLOAT_TYPES:
            raise TrainingOpError(f"{where}: input {role} ({name!r}) must be float32 or float64, found "
                                  f"{vt.dtype_name}")
        known[role] = vt.elem_type
    if len(set(known.values())) > 1:
        found = ", ".join(f"{r} {onnx.helper.tensor_dtype_to_np_dtype(t)}" for r, t in known.items())
        raise TrainingOpError(f"{where}: {', '.join(roles)} must share one dtype; found {found}")
    if known:
        return next(iter(known.values()))
    if opset >= CASTLIKE_OPSET:
        return x
    raise TrainingOpError(f"{where}: the element type of X ({x!r}) is not known statically and the model "
                          f"imports ai.onnx opset {opset} (< {CASTLIKE_OPSET}, no CastLike); add a value_info "
                          "for it or raise the opset")


def _prune(nodes: list[onnx.NodeProto], needed: set[str]) -> list[onnx.NodeProto]:
    """The emitted nodes some wanted output depends on (a node's unused outputs cost nothing)."""
    kept = []
    for nd in reversed(nodes):
        if any(o in needed for o in nd.output):
            kept.append(nd)
            needed.update(nd.input)
    return kept[::-1]


def _lower_graph(graph: GraphProto, types: dict[str, ValueType], taken: set[str], opset: int, where: str) -> None:
    new_nodes = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type not in OPTIMIZERS:
            new_nodes.append(node)
            continue
        e = Emitter(taken, opset, unique_name)
        _lower_node(e, node, types, where + node_label(node))
        new_nodes.extend(_prune(e.nodes, {o for o in node.output if o}))
    del graph.node[:]
    graph.node.extend(new_nodes)


def _default_opset(model: ModelProto) -> int:
    """The ai.onnx opset, raised to what the lowered ops need when the model imports none."""
    imports = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not imports:
        model.opset_import.append(helper.make_opsetid("", DEFAULT_OPSET))
        model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(list(model.opset_import)))
        return DEFAULT_OPSET
    return imports[0].version


def types_by_graph(model: ModelProto) -> list[tuple[GraphProto, dict[str, ValueType], str]]:
    """(top-level graph, inferred types, label prefix): the main graph, then each training_info
    graph, the algorithm typed as the IR runs it (after the main graph)."""
    from .validate import _with_graph

    out = [(model.graph, value_types(model), "")]
    for i, info in enumerate(model.training_info):
        out.append((info.initialization, value_types(_with_graph(model, info.initialization)),
                    f"training_info[{i}].initialization: "))
        algorithm = concatenated(model.graph, info.algorithm)
        out.append((info.algorithm, value_types(_with_graph(model, algorithm)), f"training_info[{i}].algorithm: "))
    return out


def lower_optimizers(model: ModelProto) -> ModelProto:
    """Replace every Adam/Momentum/Adagrad node (every graph, subgraphs and training_info
    included) by standard ops; drop the training domain's import when no node of it is left
    (in place; returns ``model``). Expects ``fill_default_attributes`` to have run."""
    if not any(n.domain == DOMAIN for g in model_graphs(model) for n in g.node):
        return model
    opset = _default_opset(model)
    uses = [n for g in model_graphs(model) for n in g.node if n.domain == DOMAIN and n.op_type in OPTIMIZERS]
    if uses and opset < MIN_OPSET:
        raise TrainingOpError(f"{node_label(uses[0])}: the portable form needs ai.onnx opset >= {MIN_OPSET} "
                              f"(Where); the model imports {opset}: convert it with onnx.version_converter")
    taken: set[str] = set()
    for graph in model_graphs(model):
        taken |= all_names(graph)
    for top, types, where in types_by_graph(model):
        # bodies before the graphs that hold them: rewriting a node list copies its nodes
        for graph in reversed(list(all_graphs(top))):
            _lower_graph(graph, types, taken, opset, where)
    if not any(n.domain == DOMAIN for g in model_graphs(model) for n in g.node):
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return model
