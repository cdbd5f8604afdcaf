"""Pass: check every optimizer node of the domain against the ONNX spec, before anything is rewritten.

Raises TrainingOpError naming the node, what was expected and what was found. Checks
what is statically known (types from shape inference); the kernels check again at run time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, ModelProto

from ..errors import TrainingOpError, node_label
from ..schema import DOMAIN, MOMENTUM_MODES, OPTIMIZERS, TRAINING_OPS
from ._graph import ValueType, concatenated, training_nodes, value_types
from .encode_exact_attributes import EXACT_ATTRIBUTE

FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def _check_scalar(label: str, input_name: str, value: str, vt: ValueType | None, allowed: tuple[int, ...], what: str):
    if vt is None:
        return
    bad_type = vt.elem_type not in allowed
    bad_shape = vt.shape is not None and not (
        len(vt.shape) == 0 or (len(vt.shape) == 1 and (vt.shape[0] in (1, None) or isinstance(vt.shape[0], str)))
    )
    if bad_type or bad_shape:
        shape = "unknown" if vt.shape is None else list(vt.shape)
        raise TrainingOpError(
            f"{label}: input {input_name!r} ({value!r}) must be {what} of shape [] or [1], "
            f"found {vt.dtype_name} of shape {shape}"
        )


def _check_attributes(node, label: str) -> None:
    spec = OPTIMIZERS[node.op_type]
    known = set(spec.all_attribute_names())
    for attr in node.attribute:
        if attr.name == EXACT_ATTRIBUTE:
            continue
        if attr.name not in known:
            raise TrainingOpError(
                f"{label}: unknown attribute {attr.name!r}; {node.op_type} has {', '.join(sorted(known))}"
            )
        expected = AttributeProto.FLOAT if attr.name in spec.float_attributes else AttributeProto.STRING
        if attr.type != expected:
            raise TrainingOpError(
                f"{label}: attribute {attr.name!r} must be {AttributeProto.AttributeType.Name(expected)}, "
                f"found {AttributeProto.AttributeType.Name(attr.type)}"
            )
    present = {a.name for a in node.attribute}
    missing = [name for name in spec.required if name not in present]
    if missing:
        raise TrainingOpError(
            f"{label}: missing required attribute(s) {', '.join(map(repr, missing))} "
            f"({node.op_type} requires {', '.join(spec.required)})"
        )
    for attr in node.attribute:
        if attr.name == "mode":
            mode = attr.s.decode(errors="replace")
            if mode not in MOMENTUM_MODES:
                raise TrainingOpError(f"{label}: attribute 'mode' must be 'standard' or 'nesterov', found {mode!r}")
        if node.op_type == "Adam" and attr.name == "alpha" and attr.f >= 1.0:
            # the bias correction divides by 1 - alpha**T
            raise TrainingOpError(f"{label}: attribute 'alpha' must be < 1 (Adam divides by "
                                  f"1 - alpha^T), found {attr.f}")


def _check_counts(node, label: str) -> int:
    spec = OPTIMIZERS[node.op_type]
    per = ", ".join(spec.tensor_inputs)
    n = spec.n_tensors(len(node.input))
    if n is None:
        raise TrainingOpError(
            f"{label}: expected 2 + {spec.n_groups_in}*N inputs (R, T, then N each of {per}), "
            f"found {len(node.input)} inputs"
        )
    expected_out = n * spec.n_groups_out
    if len(node.output) != expected_out:
        raise TrainingOpError(
            f"{label}: {len(node.input)} inputs optimize {n} tensor(s), so expected {expected_out} outputs "
            f"({', '.join(spec.tensor_outputs)} per tensor), found {len(node.output)}"
        )
    for i, name in enumerate(node.input):
        if not name:
            raise TrainingOpError(f"{label}: input {i} is empty; every input of {node.op_type} is required")
    return n


def _check_group_types(node, label: str, n: int, types: dict[str, ValueType]) -> None:
    spec = OPTIMIZERS[node.op_type]
    for i in range(n):
        names = [node.input[2 + j * n + i] for j in range(spec.n_groups_in)]
        known = [(role, name, types.get(name)) for role, name in zip(spec.tensor_inputs, names)]
        for role, name, vt in known:
            if vt is not None and vt.elem_type not in FLOAT_TYPES:
                raise TrainingOpError(
                    f"{label}: input {role}{i} ({name!r}) must be float or double, found {vt.dtype_name}"
                )
        typed = [(role, name, vt) for role, name, vt in known if vt is not None]
        if len({vt.elem_type for _, _, vt in typed}) > 1:
            found = ", ".join(f"{role}{i} ({name!r}) is {vt.dtype_name}" for role, name, vt in typed)
            raise TrainingOpError(f"{label}: {', '.join(spec.tensor_inputs)} of tensor {i} "
                                  f"must share one dtype; {found}")
        x_type = known[0][2]
        shapes = [shape for _, _, vt in typed if (shape := vt.static_shape) is not None]
        if x_type is None or x_type.static_shape is None or len(shapes) != len(known):
            continue
        try:
            common = np.broadcast_shapes(*shapes)
        except ValueError:
            common = None
        if common != x_type.static_shape:
            found = ", ".join(f"{role}{i} {list(shape)}" for (role, _, _), shape in zip(typed, shapes))
            raise TrainingOpError(
                f"{label}: shapes of tensor {i} must broadcast to the shape of X{i} {list(x_type.static_shape)}; "
                f"found {found}"
            )


def _check_structure(graph: onnx.GraphProto, outer: set[str], where: str) -> None:
    """What onnxruntime would reject with a less helpful message: a value produced twice, an
    input nothing produces, nodes out of order (or in a cycle). Subgraphs see ``outer``."""
    defined = set(outer) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.name for t in graph.sparse_initializer}
    producers: dict[str, str] = {}
    all_outputs = {o for n in graph.node for o in n.output if o}
    for node in graph.node:
        label = node_label(node)
        for name in node.input:
            if name and name not in defined:
                later = "produced only by a later node (nodes out of order, or a cycle)" \
                    if name in all_outputs else "produced by no node, graph input or initializer"
                raise TrainingOpError(f"{where}{label}: input {name!r} is {later}")
        for sub in _subgraphs(node):
            _check_structure(sub, defined, f"{where}{label} body: ")
        for name in node.output:
            if not name:
                continue
            if name in producers:
                raise TrainingOpError(f"{where}{label}: output {name!r} is already produced "
                                      f"by {producers[name]}")
            if name in {v.name for v in graph.input} or name in \
                    {t.name for t in graph.initializer}:
                raise TrainingOpError(f"{where}{label}: output {name!r} overwrites a graph "
                                      "input or initializer")
            producers[name] = label
            defined.add(name)


def _subgraphs(node):
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == AttributeProto.GRAPHS:
            yield from attr.graphs


def _check_nodes(model: ModelProto, graph: onnx.GraphProto, where: str) -> None:
    """The spec's checks for every node of the domain in ``graph`` (types inferred in ``model``)."""
    nodes = list(training_nodes(graph))
    if not nodes:
        return
    types = value_types(model)
    for _, node in nodes:
        label = where + node_label(node)
        if node.op_type not in TRAINING_OPS:
            raise TrainingOpError(
                f"{label}: unknown op of domain ai.onnx.preview.training; it has {', '.join(TRAINING_OPS)}"
            )
        if node.op_type == "Gradient":
            continue  # checked by the expand_gradient pass, which knows the forward graph
        n = _check_counts(node, label)
        _check_attributes(node, label)
        _check_scalar(label, "R", node.input[0], types.get(node.input[0]), FLOAT_TYPES, "a float or double scalar")
        _check_scalar(label, "T", node.input[1], types.get(node.input[1]), (onnx.TensorProto.INT64,), "an int64 scalar")
        _check_group_types(node, label, n, types)


def _with_graph(model: ModelProto, graph: onnx.GraphProto) -> ModelProto:
    """``model``'s opsets and functions around another graph (for shape inference)."""
    other = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    other.ir_version = model.ir_version
    other.functions.extend(model.functions)
    return other


def validate(model: ModelProto) -> ModelProto:
    """Raise TrainingOpError for the first invalid node of the domain, the domain's opset
    version, or a graph onnxruntime would reject structurally; return ``model``.

    Covers the main graph and, for a training model, every ``training_info`` graph: the
    initialization graph on its own (it may read the main graph's initializers) and the
    algorithm graph as the IR runs it, concatenated after the main graph."""
    if not model.training_info and not any(True for _ in training_nodes(model.graph)):
        return model
    for imp in model.opset_import:
        if imp.domain == DOMAIN and imp.version != 1:
            raise TrainingOpError(f"the model imports {DOMAIN} version {imp.version}; only "
                                  "version 1 exists")
    _check_structure(model.graph, set(), "")
    _check_nodes(model, model.graph, "")
    main_initializers = {t.name for t in model.graph.initializer}
    for i, info in enumerate(model.training_info):
        init = info.initialization
        _check_structure(init, set(main_initializers), f"training_info[{i}].initialization: ")
        _check_nodes(_with_graph(model, init), init, f"training_info[{i}].initialization: ")
        algorithm = concatenated(model.graph, info.algorithm)
        _check_structure(algorithm, set(), f"training_info[{i}].algorithm: ")
        _check_nodes(_with_graph(model, algorithm), info.algorithm,
                     f"training_info[{i}].algorithm: ")
    return model
