"""Graph walking shared by the passes: every graph of a model, subgraphs included, and value types."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto

from ..autodiff.contrib_shapes import complete
from ..autodiff.emitter import ValueMeta
from ..schema import DOMAIN
from ..walk import all_graphs, model_graphs, subgraphs  # noqa: F401 - re-exported for the passes


def concatenated(main: GraphProto, algorithm: GraphProto) -> GraphProto:
    """The graph the IR runs for a training algorithm: the main graph's nodes, then the
    algorithm's; inputs, initializers and value_info of both (the algorithm's outputs). An
    algorithm input naming a value the main graph computes is that value, not an input."""
    combined = GraphProto()
    combined.CopyFrom(algorithm)
    del combined.node[:]
    combined.node.extend(main.node)
    combined.node.extend(algorithm.node)
    computed = {o for n in main.node for o in n.output if o}
    inputs = [v for v in combined.input if v.name not in computed]
    del combined.input[:]
    combined.input.extend(inputs)
    seen = {v.name for v in combined.input}
    combined.input.extend(v for v in main.input if v.name not in seen)
    own = {t.name for t in combined.initializer}
    combined.initializer.extend(t for t in main.initializer if t.name not in own)
    combined.sparse_initializer.extend(main.sparse_initializer)
    combined.value_info.extend(main.value_info)
    return combined


def model_training_nodes(model: ModelProto) -> Iterator[tuple[GraphProto, NodeProto]]:
    """(graph, node) for every node of the training domain in any graph of ``model``."""
    for g in model_graphs(model):
        for node in g.node:
            if node.domain == DOMAIN:
                yield g, node


def training_nodes(graph: GraphProto) -> Iterator[tuple[GraphProto, NodeProto]]:
    """(graph, node) for every node of the training domain, subgraphs included."""
    for g in all_graphs(graph):
        for node in g.node:
            if node.domain == DOMAIN:
                yield g, node


@dataclass(frozen=True)
class ValueType:
    """What is statically known of a value: element type and shape (None = unknown dim/rank)."""

    elem_type: int
    shape: tuple[int | str | None, ...] | None

    @property
    def dtype_name(self) -> str:
        return onnx.helper.tensor_dtype_to_string(self.elem_type).replace("TensorProto.", "").lower()

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        if self.shape is None:
            return None
        dims = tuple(d for d in self.shape if isinstance(d, int))
        return dims if len(dims) == len(self.shape) else None


def _from_type_proto(tp: onnx.TypeProto) -> ValueType | None:
    if not tp.HasField("tensor_type"):
        return None
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return ValueType(tt.elem_type, None)
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
    )
    return ValueType(tt.elem_type, dims)


def stub(tensor: onnx.TensorProto, limit: int = 4096) -> onnx.TensorProto:
    """``tensor``, or past ``limit`` elements a copy with its type and dims only (marked external):
    shape inference reads no more, and a model whose weights live in its message (a small one)
    is not copied whole for it, several times over (serialized, parsed, inferred, serialized
    and parsed back)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL or int(np.prod(tensor.dims, dtype=np.int64)) <= limit:
        return tensor
    out = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    out.data_location = onnx.TensorProto.EXTERNAL
    out.external_data.add(key="location", value=f"#{tensor.name}")
    return out


def skeleton(graph: GraphProto) -> GraphProto:
    """A copy of ``graph`` whose big initializers are :func:`stub` s (for shape inference)."""
    g = GraphProto(name=graph.name, doc_string=graph.doc_string)
    g.node.extend(graph.node)
    g.input.extend(graph.input)
    g.output.extend(graph.output)
    g.value_info.extend(graph.value_info)
    g.sparse_initializer.extend(graph.sparse_initializer)
    g.initializer.extend(stub(t) for t in graph.initializer)
    return g


def skeleton_model(model: ModelProto) -> ModelProto:
    """``model`` without ``training_info`` and with its main graph's big initializers
    :func:`stub` s: what onnx's shape inference reads."""
    out = ModelProto(ir_version=model.ir_version, producer_name=model.producer_name, domain=model.domain,
                     model_version=model.model_version)
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(skeleton(model.graph))
    return out


def value_types(model: ModelProto) -> dict[str, ValueType]:
    """Every value name (all graphs, after shape inference) -> its known type."""
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton_model(model), check_type=False, strict_mode=False,
                                                      data_prop=True)
    except Exception:  # inference is a help for validation, never a requirement
        inferred = model
    types: dict[str, ValueType] = {}
    for g in all_graphs(inferred.graph):
        for init in g.initializer:
            types[init.name] = ValueType(init.data_type, tuple(init.dims))
        for vi in (*g.input, *g.value_info, *g.output):
            vt = _from_type_proto(vi.type)
            if vt is not None and (vi.name not in types or types[vi.name].shape is None):
                types[vi.name] = vt
    if not all(onnx_infers(n) for n in inferred.graph.node):
        _through_contrib_ops(inferred, types)
    return types


def onnx_infers(node: NodeProto) -> bool:
    """Whether onnx's shape inference knows ``node``'s op (an onnxruntime contrib op, or the
    ``SimplifiedLayerNormalization`` schema registered without inference, it does not)."""
    return _infers(node.op_type, "" if node.domain == "ai.onnx" else node.domain)


@functools.lru_cache(maxsize=1024)
def _infers(op_type: str, domain: str) -> bool:
    if not onnx.defs.has(op_type, domain):
        return False
    return onnx.defs.get_schema(op_type, domain).has_type_and_shape_inference_function


def _through_contrib_ops(model: ModelProto, types: dict[str, ValueType]) -> None:
    """``types`` completed past the main graph's onnxruntime contrib ops (``com.microsoft``),
    where onnx's inference stops (:func:`~..autodiff.contrib_shapes.complete`): a loss after an
    onnxruntime-genai graph's int4 LM head gets its logits' shape."""
    graph = model.graph
    # a value of unknown shape is left for the walk to compute again (onnx gave up on it midway)
    meta = {name: ValueMeta(t.elem_type or None, t.shape) for name, t in types.items() if t.shape is not None}
    constants = {t.name: t for t in graph.initializer
                 if not t.external_data and t.data_location != onnx.TensorProto.EXTERNAL and len(t.dims) <= 1
                 and int(np.prod(t.dims, dtype=np.int64)) <= 64}
    constants.update({n.output[0]: n.attribute[0].t for n in graph.node if n.op_type == "Constant"
                      and n.domain in ("", "ai.onnx") and n.attribute and n.attribute[0].name == "value"})
    complete(graph.node, meta, constants, model.opset_import)
    for name, m in meta.items():
        if m.dtype and (name not in types or types[name].shape is None):
            types[name] = ValueType(m.dtype, m.shape)


def unique_name(taken: set[str], base: str) -> str:
    """``base`` or ``base_1``, ``base_2``...: the first not in ``taken`` (which it joins)."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def all_names(graph: GraphProto) -> set[str]:
    """Every value and node name used anywhere in ``graph`` and its subgraphs."""
    names: set[str] = set()
    for g in all_graphs(graph):
        names.update(i.name for i in g.input)
        names.update(i.name for i in g.initializer)
        for node in g.node:
            names.update(node.input)
            names.update(node.output)
            names.add(node.name)
    names.discard("")
    return names


def rename_values(nodes: Iterable[onnx.NodeProto], names: Mapping[str, str]) -> None:
    """Every input and output of ``nodes`` that ``names`` maps, renamed in place to what it maps to."""
    for node in nodes:
        for values in (node.input, node.output):
            for i, name in enumerate(values):
                if name in names:
                    values[i] = names[name]
