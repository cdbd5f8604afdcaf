"""Pass: replace every ``ai.onnx.preview.training::Gradient`` node by ordinary ONNX ops.

``Gradient(xs=[...], zs=[...], y=...)(values of xs..., values of zs...)`` outputs
``d sum(y) / d xs[i]`` (for a non-scalar ``y``, the gradient of the sum of its elements,
i.e. the vector-Jacobian product with a ones seed). The differentiated computation is the
part of the enclosing graph that computes ``y`` from the xs and zs names: the walk from
``y`` stops at those names; everything else it reaches (graph inputs, initializers,
Constants, outer-scope values, integer and shape-derived values) is a constant.

When the node's inputs are exactly ``xs + zs`` the existing forward values are reused;
otherwise the forward nodes downstream of xs/zs are copied with the node's inputs
substituted (renamed ``<prefix>fwd/<name>``) and differentiated at those values.

Gradient nodes are expanded in the main graph, in control-flow bodies (If/Loop/Scan) and
in ``training_info[*].algorithm`` (and ``initialization``) graphs. Emitted names start
with ``<gradient node name>/grad/``. See ``docs/gradient.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper

from ..autodiff import ValueMeta, topological_sort
from ..autodiff.contrib_shapes import complete as complete_shapes
from ..autodiff.native_ops import ALL as NATIVE_GRAD_OPS
from ..autodiff.native_ops import CONV_BY_CONV, GPU_RANGES
from ..autodiff.native_ops import DOMAIN as NATIVE_DOMAIN
from ..errors import TrainingOpError
from ..storage.tensors import location
from ..walk import all_graphs
from ._gradient_node import Scope, expand_node
from ._graph import all_names, concatenated
from ._graph import skeleton as _skeleton
from ._graph import stub as _stub

DOMAIN = "ai.onnx.preview.training"

__all__ = ["expand_gradient", "expand_gradient_gpu", "expand_gradient_native", "expand_gradients_in_graph"]


# ----------------------------------------------------------------------------- helpers
def _is_gradient(node: NodeProto) -> bool:
    return node.op_type == "Gradient" and node.domain == DOMAIN


def _graph_attrs(node: NodeProto) -> Iterator[tuple[onnx.AttributeProto, int | None]]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr, None
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for i in range(len(attr.graphs)):
                yield attr, i


def _has_gradient(graph: GraphProto) -> bool:
    return any(_is_gradient(n) for g in all_graphs(graph) for n in g.node)


def _meta_of_graph(graph: GraphProto, into: dict[str, ValueMeta]) -> dict[str, ValueMeta]:
    for g in all_graphs(graph):
        for t in g.initializer:
            into.setdefault(t.name, ValueMeta(t.data_type, tuple(int(d) for d in t.dims)))
        for v in list(g.input) + list(g.output) + list(g.value_info):
            meta = ValueMeta.from_type(v.type)
            if meta.dtype is not None or v.name not in into:
                into[v.name] = meta
    return into


def _infer(graph: GraphProto, opset_imports, ir_version: int,
           extra_initializers=()) -> dict[str, ValueMeta]:
    """Shape-inferred value facts of every graph under ``graph`` (best effort). With data
    propagation: shapes computed by Shape/Gather/Concat... subgraphs (the exporters' reshape
    targets) become static, so the rules emit static shapes instead of runtime ones."""
    g = _skeleton(graph)
    have = {t.name for t in g.initializer} | {v.name for v in g.input}
    g.initializer.extend(_stub(t) for t in extra_initializers if t.name not in have)
    model = helper.make_model(g, opset_imports=list(opset_imports))
    model.ir_version = max(ir_version, 7)
    for data_prop in (True, False):  # data_prop: shapes computed by Shape/Gather/Concat (the
        try:  # exporters' reshape targets, Whisper's TorchScript Expand) become static
            model = onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
            break
        except Exception:  # inference is an aid, not a requirement
            pass
    meta = _meta_of_graph(model.graph, {})
    complete_shapes(model.graph.node, meta, _small_constants(model.graph), model.opset_import)
    return meta


def _small_constants(graph: GraphProto, limit: int = 4096) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant values of at most ``limit`` elements held in the message
    (shape targets, axes): the data onnx's per-node inference reads."""
    small = {t.name: t for t in graph.initializer
             if location(t) is None and int(np.prod(t.dims, dtype=np.int64)) <= limit}
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.attribute and n.attribute[0].name == "value":
            small[n.output[0]] = n.attribute[0].t
    return small


def _reinfer(template: GraphProto, opset_imports, ir_version: int,
             extra_initializers=()) -> Callable[[list[NodeProto]], dict[str, ValueMeta]]:
    """``run(nodes)``: :func:`_infer` of ``template`` with its nodes replaced by ``nodes`` (the
    value facts again after a Gradient node was expanded)."""
    template = _skeleton(template)
    extra_initializers = [_stub(t) for t in extra_initializers]

    def run(nodes: list[NodeProto]) -> dict[str, ValueMeta]:
        g = GraphProto()
        g.CopyFrom(template)
        del g.node[:]
        g.node.extend(nodes)
        return _infer(g, opset_imports, ir_version, extra_initializers)
    return run


class _Constants(Mapping):
    """Values of initializers and Constant nodes, converted to numpy on first use."""

    def __init__(self, parent: Mapping | None, graph: GraphProto, extra=()):
        self._parent = parent
        self._protos: dict[str, object] = {}
        for t in list(extra) + list(graph.initializer):
            self._protos[t.name] = t
        for n in graph.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output:
                self._protos[n.output[0]] = n
        self._cache: dict[str, np.ndarray | None] = {}

    def _convert(self, proto) -> np.ndarray | None:
        if isinstance(proto, onnx.TensorProto):  # a weight outside the message is no constant here
            return None if location(proto) is not None else numpy_helper.to_array(proto)
        for a in proto.attribute:
            v = helper.get_attribute_value(a)
            if a.name == "value":
                return numpy_helper.to_array(v)
            if a.name in ("value_int", "value_ints", "value_float", "value_floats"):
                return np.asarray(v)
        return None

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._protos:
            if name not in self._cache:
                self._cache[name] = self._convert(self._protos[name])
            value = self._cache[name]
            if value is None:
                raise KeyError(name)
            return value
        if self._parent is not None:
            return self._parent[name]
        raise KeyError(name)

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def __iter__(self):
        return iter(self._protos)

    def __len__(self) -> int:
        return len(self._protos)


# ----------------------------------------------------------------------------- graphs
def _expand_graph(graph: GraphProto, opset: int, meta: dict[str, ValueMeta],
                  constants: Mapping, taken: set[str], refresh=None,
                  outer: frozenset | None = frozenset(), native: frozenset = frozenset()) -> GraphProto:
    """Expand the Gradient nodes of ``graph`` (bodies first). ``outer``: the names visible
    from enclosing scopes (None when unknown: then undefined xs/y are not diagnosed)."""
    out = GraphProto()
    out.CopyFrom(graph)
    if not _has_gradient(out):
        return out
    nodes = list(out.node)
    own = {v.name for v in out.input} | {t.name for t in out.initializer}

    def visible() -> frozenset | None:
        if outer is None:
            return None
        return outer | own | {o for n in nodes for o in n.output if o}

    for node in nodes:  # control-flow bodies first
        for attr, i in _graph_attrs(node):
            sub = attr.g if i is None else attr.graphs[i]
            if _has_gradient(sub):
                new = _expand_graph(sub, opset, meta, _Constants(constants, sub), taken,
                                    outer=visible(), native=native)
                sub.CopyFrom(new)
    expanded = 0
    grad_outputs: set[str] = set()
    while True:
        idx = next((k for k, n in enumerate(nodes) if _is_gradient(n)), None)
        if idx is None:
            break
        if expanded and refresh is not None:
            meta.update(refresh(nodes))
        grad_outputs.update(o for o in nodes[idx].output if o)
        new_nodes = expand_node(nodes[idx], expanded, nodes, Scope(opset, meta, constants, taken, native),
                                visible())
        nodes = topological_sort(nodes[:idx] + new_nodes + nodes[idx + 1:])
        expanded += 1
    del out.node[:]
    out.node.extend(nodes)
    _type_gradient_outputs(out, grad_outputs, meta)
    return out


def _type_gradient_outputs(graph: GraphProto, names: set[str], meta: Mapping) -> None:
    """Give untyped graph outputs that carry a gradient the type of their xs."""
    for v in graph.output:
        m = meta.get(v.name)
        if v.name in names and not v.HasField("type") and m is not None and m.dtype:
            shape = None if m.shape is None else list(m.shape)
            v.type.CopyFrom(helper.make_tensor_type_proto(m.dtype, shape))


def _meta_from_value_info(value_info: Mapping) -> dict[str, ValueMeta]:
    meta: dict[str, ValueMeta] = {}
    for name, v in value_info.items():
        if isinstance(v, ValueMeta):
            meta[name] = v
        elif isinstance(v, onnx.ValueInfoProto):
            meta[name] = ValueMeta.from_type(v.type)
        elif isinstance(v, onnx.TypeProto):
            meta[name] = ValueMeta.from_type(v)
    return meta


def expand_gradients_in_graph(graph: GraphProto, opset: int,
                              value_info: dict | None = None) -> GraphProto:
    """Return a copy of ``graph`` with its Gradient nodes (subgraphs included) expanded.

    ``opset`` is the graph's default-domain opset. ``value_info`` maps value names to
    ``ValueInfoProto`` (or ``TypeProto``) for values visible in the graph, outer-scope ones
    included; when None, the graph is shape-inferred on its own.
    """
    given = _meta_from_value_info(value_info or {})
    probe = GraphProto()
    probe.CopyFrom(graph)
    defined = ({v.name for v in graph.input} | {t.name for t in graph.initializer}
               | {o for n in graph.node for o in n.output})
    for name, v in (value_info or {}).items():  # outer-scope values: typed inputs for inference
        if name not in defined and isinstance(v, (onnx.ValueInfoProto, onnx.TypeProto)):
            tp = v.type if isinstance(v, onnx.ValueInfoProto) else v
            probe.input.append(helper.make_value_info(name, tp))
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)]
    meta = given
    for name, m in _infer(probe, imports, 8).items():
        if m.dtype is not None or name not in meta:
            meta[name] = m
    outer = None if value_info is None else frozenset(value_info)
    return _expand_graph(graph, opset, meta, _Constants(None, graph), all_names(graph),
                         outer=outer)


def _default_opset(model: ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise TrainingOpError("the model imports no default-domain opset; the Gradient expansion "
                          "needs one to emit ordinary ONNX ops")


def expand_gradient(model: ModelProto, native: frozenset = frozenset()) -> ModelProto:
    """Return a copy of ``model`` whose Gradient nodes are replaced by ordinary ONNX ops.

    Covers the main graph, control-flow subgraphs and ``training_info`` graphs. The
    training-domain opset import is kept (other nodes of the domain may remain).
    ``native``: native backward ops (``autodiff.native_ops``) the rules may emit instead
    of their standard-op forms (:func:`expand_gradient_native`).
    """
    out = ModelProto()
    out.CopyFrom(model)
    graphs = [out.graph] + [g for ti in out.training_info for g in (ti.algorithm, ti.initialization)]
    if not any(_has_gradient(g) for g in graphs):
        return out
    opset = _default_opset(out)
    taken: set[str] = set()
    for g in graphs:
        taken |= all_names(g)
    imports = list(out.opset_import)
    if _has_gradient(out.graph):
        meta = _infer(out.graph, imports, out.ir_version)
        new = _expand_graph(out.graph, opset, meta, _Constants(None, out.graph), taken,
                            _reinfer(out.graph, imports, out.ir_version), native=native)
        out.graph.CopyFrom(new)
    main_inits = list(model.graph.initializer)
    for ti in out.training_info:
        if _has_gradient(ti.algorithm):
            _expand_algorithm(ti.algorithm, model.graph, opset, imports, out.ir_version, taken, native)
        g = ti.initialization
        if _has_gradient(g):
            meta = _infer(g, imports, out.ir_version, main_inits)
            consts = _Constants(_Constants(None, model.graph), g)
            new = _expand_graph(g, opset, meta, consts, taken, _reinfer(g, imports, out.ir_version, main_inits),
                                outer=frozenset(t.name for t in main_inits), native=native)
            g.CopyFrom(new)
    if any(n.domain == NATIVE_DOMAIN for g in graphs for n in g.node) and \
            not any(o.domain == NATIVE_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, 1))
    return out


def expand_gradient_native(model: ModelProto) -> ModelProto:
    """:func:`expand_gradient` for the native path: rules may emit every native backward op."""
    return expand_gradient(model, native=NATIVE_GRAD_OPS)


def expand_gradient_gpu(model: ModelProto) -> ModelProto:
    """:func:`expand_gradient` for a GPU: standard ops, convolution gradients as onnxruntime's
    Conv/ConvTranspose (cuDNN) rather than the CPU's im2col Gemms."""
    return expand_gradient(model, native=frozenset({CONV_BY_CONV, GPU_RANGES}))


def _expand_algorithm(algorithm: GraphProto, main: GraphProto, opset: int, imports,
                      ir_version: int, taken: set[str], native: frozenset = frozenset()) -> None:
    """Expand an algorithm graph's Gradient nodes in place. The IR runs the algorithm on the
    main graph and the algorithm graph concatenated, so y may depend on xs through the main
    graph's nodes (a loss reading the model's logits): differentiate the concatenation, then
    keep only what is not the main graph's (the emitted nodes read main values by name)."""
    combined = concatenated(main, algorithm)
    meta = _infer(combined, imports, ir_version)
    consts = _Constants(None, combined)
    new = _expand_graph(combined, opset, meta, consts, taken, _reinfer(combined, imports, ir_version),
                        native=native)
    main_outputs = {o for n in main.node for o in n.output if o}
    nodes = [n for n in new.node if not (n.output and all(o in main_outputs for o in n.output if o))]
    del algorithm.node[:]
    algorithm.node.extend(nodes)
