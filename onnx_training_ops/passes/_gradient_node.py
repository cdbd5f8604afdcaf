"""One Gradient node expanded, in named steps: read its request (:func:`_request`), find the
forward computation to differentiate (:func:`_forward`: the graph's own nodes, or copies at the
node's inputs), run the reverse-mode walk, and name the results (:func:`_name_outputs`).
:mod:`.expand_gradient` calls :func:`expand_node` for every Gradient node of every graph.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import NodeProto, helper

from ..autodiff import Emitter, ValueMeta, backprop
from ..autodiff.emitter import FLOAT_TYPES
from ..autodiff.graph import ancestors, node_reads, producer_map
from ..errors import TrainingOpError, node_label


def _strings(node: NodeProto, name: str) -> list[str] | None:
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            if isinstance(v, bytes):
                return [v.decode()]
            return [s.decode() if isinstance(s, bytes) else s for s in v]
    return None


def _prefix(node: NodeProto, index: int, taken: set[str]) -> str:
    base = node.name or (node.output[0] if len(node.output) and node.output[0] else
                         f"Gradient_{index}")
    prefix, k = f"{base}/grad/", 1
    while any(t.startswith(prefix) for t in taken):
        k += 1
        prefix = f"{base}_{k}/grad/"
    return prefix


def _check_independent(label: str, nodes, producers, xs: list[str], zs: list[str],
                       cut: set[str]) -> None:
    """The spec: an xs/zs name must not be computed from other xs/zs names."""
    for name in xs + zs:
        if name not in producers:
            continue
        others = cut - {name}
        found: set[str] = set()
        for idx in ancestors(nodes, producers, [name], others):
            found.update(i for i in node_reads(nodes[idx]) if i in others)
        if found:
            raise TrainingOpError(
                f"{label}: {'xs' if name in xs else 'zs'} {name!r} is computed from "
                f"{sorted(found)} (also in xs/zs); "
                "xs and zs must be independent inputs of the differentiated computation")


def _check_substitutes(label: str, subst: Mapping[str, str], meta: Mapping[str, ValueMeta]) -> None:
    """Each input of the node is the value of its xs/zs name: same dtype, same rank."""
    for name, value in subst.items():
        want, got = meta.get(name, ValueMeta()), meta.get(value, ValueMeta())
        if want.dtype is not None and got.dtype is not None and want.dtype != got.dtype:
            raise TrainingOpError(
                f"{label}: input {value!r} stands for {name!r} but is "
                f"{onnx.helper.tensor_dtype_to_string(got.dtype)}, {name!r} is "
                f"{onnx.helper.tensor_dtype_to_string(want.dtype)}")
        if want.shape is not None and got.shape is not None and len(want.shape) != len(got.shape):
            # dims may differ (the spec's example evaluates at another batch size); ranks not
            raise TrainingOpError(f"{label}: input {value!r} stands for {name!r} but has rank "
                                  f"{len(got.shape)} (shape {list(got.shape)}), {name!r} has "
                                  f"rank {len(want.shape)} (shape {list(want.shape)})")


def _check_forward_accepts(label: str, copies: list[NodeProto], meta: Mapping[str, ValueMeta],
                           opset: int) -> None:
    """Shape-infer the forward nodes re-evaluated at the node's inputs: values that do not fit
    them (a [2, 3] fed for a [3, 2] weight) are this node's error, not onnxruntime's later."""
    if not copies or any(n.domain not in ("", "ai.onnx") for n in copies):
        return
    produced = {o for n in copies for o in n.output if o}
    inputs = []
    for name in dict.fromkeys(i for n in copies for i in n.input if i and i not in produced):
        m = meta.get(name, ValueMeta())
        if m.dtype is None:
            return  # too little is known to judge
        inputs.append(helper.make_tensor_value_info(name, m.dtype, None if m.shape is None else list(m.shape)))
    graph = helper.make_graph(list(copies), "forward", inputs,
                              [helper.make_tensor_value_info(o, 0, None) for o in produced])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        onnx.shape_inference.infer_shapes(probe, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError as error:
        raise TrainingOpError(f"{label}: the forward graph, re-evaluated at this node's inputs, "
                              f"does not accept them: {str(error).splitlines()[0]}") from None
    except Exception:  # noqa: BLE001 - inference itself is a help, not a requirement
        return


@dataclass(frozen=True)
class _Request:
    """What a Gradient node asks for: d sum(y) / d xs, the zs held as cut points."""

    label: str
    xs: list[str]
    zs: list[str]
    y: str


@dataclass(frozen=True)
class Scope:
    """What every Gradient node of one graph is expanded with.

    Attributes:
        opset: the default-domain opset the emitted ops use.
        meta: value facts (dtype, shape) by name; gains the emitted values'.
        constants: the values of initializers and Constant nodes.
        taken: names in use; gains the emitted ones.
        native: the native backward ops the rules may emit.
    """

    opset: int
    meta: dict[str, ValueMeta]
    constants: Mapping
    taken: set[str]
    native: frozenset = frozenset()


@dataclass(frozen=True)
class _Forward:
    """The computation to differentiate: its nodes, the leaves (xs' values) and y."""

    nodes: list[NodeProto]
    leaves: list[str]
    y: str
    cut: set[str]
    copies: list[NodeProto]  # the forward nodes copied at the node's inputs (empty when reused)


def _request(gnode: NodeProto, meta: Mapping[str, ValueMeta], visible: frozenset | None) -> _Request:
    """The node's xs, zs and y, checked against its inputs, outputs and the visible names."""
    label = node_label(gnode)
    xs = _strings(gnode, "xs")
    zs = _strings(gnode, "zs") or []
    ys = _strings(gnode, "y")
    if not ys or not ys[0]:
        raise TrainingOpError(f"{label}: the required attribute 'y' is missing")
    if not xs:
        raise TrainingOpError(f"{label}: the required attribute 'xs' is missing or empty")
    y = ys[0]
    if len(gnode.input) != len(xs) + len(zs):
        raise TrainingOpError(
            f"{label}: has {len(gnode.input)} inputs, expected len(xs) + len(zs) = "
            f"{len(xs)} + {len(zs)} = {len(xs) + len(zs)} (values of xs then zs)")
    if len(gnode.output) > len(xs):
        raise TrainingOpError(f"{label}: has {len(gnode.output)} outputs but only {len(xs)} xs")
    if visible is not None:
        for kind, names in (("y", [y]), ("xs", xs), ("zs", zs)):
            unknown = [n for n in names if n not in visible]
            if unknown:
                raise TrainingOpError(f"{label}: {kind} {unknown} not a value of the graph "
                                      "(no input, initializer or node output has that name)")
    for x in xs:
        dtype = meta.get(x, ValueMeta()).dtype
        if dtype is not None and dtype not in FLOAT_TYPES:
            raise TrainingOpError(
                f"{label}: xs {x!r} is {onnx.helper.tensor_dtype_to_string(dtype)}; only "
                "floating-point tensors have gradients")
    return _Request(label, xs, zs, y)


def _forward(req: _Request, gnode: NodeProto, nodes: list[NodeProto], producers, scope: Scope,
             prefix: str) -> _Forward:
    """The graph's own forward nodes when the node's inputs are exactly ``xs + zs``; else
    copies of the nodes downstream of xs/zs with the node's inputs substituted."""
    cut = set(req.xs) | set(req.zs)
    if list(gnode.input) == req.xs + req.zs:
        return _Forward(nodes, list(req.xs), req.y, cut, [])
    meta, label = scope.meta, req.label
    subst = dict(zip(req.xs + req.zs, gnode.input))
    _check_substitutes(label, subst, meta)
    same = all(meta.get(k, ValueMeta()).shape == meta.get(v, ValueMeta()).shape
               and meta.get(k, ValueMeta()).shape is not None for k, v in subst.items())
    rename: dict[str, str] = {}
    downstream = set(cut)
    copies: list[NodeProto] = []
    for idx in ancestors(nodes, producers, [req.y], cut):
        node = nodes[idx]
        reads = node_reads(node)
        if not any(i in downstream for i in reads):
            continue
        if any(i in downstream for i in reads[len(node.input):]):
            raise TrainingOpError(
                f"{label}: cannot re-evaluate {node_label(node)} at the Gradient inputs "
                "(its subgraph reads a substituted value)")
        copy = NodeProto()
        copy.CopyFrom(node)
        copy.name = f"{prefix}fwd/{node.name or node.output[0]}"
        del copy.input[:]
        copy.input.extend(subst.get(i, rename.get(i, i)) for i in node.input)
        del copy.output[:]
        for o in node.output:
            if o:
                downstream.add(o)
                rename[o] = f"{prefix}fwd/{o}"
                m = meta.get(o, ValueMeta())
                meta[rename[o]] = m if same else ValueMeta(
                    m.dtype, None if m.shape is None else (None,) * len(m.shape))
            copy.output.append(rename.get(o, "") if o else "")
        copies.append(copy)
    _check_forward_accepts(label, copies, meta, scope.opset)
    y = subst.get(req.y, rename.get(req.y, req.y))
    return _Forward(copies, [subst[x] for x in req.xs], y, set(gnode.input), copies)


def _final_gradients(gnode: NodeProto, grads: Mapping, leaves: list[str], em: Emitter,
                     label: str) -> dict[int, str]:
    """Output index -> the gradient value it takes (zeros where y does not depend on the x)."""
    finals = {}
    for i, out in enumerate(gnode.output):
        if not out:
            continue
        try:
            finals[i] = grads[leaves[i]] or em.filled_like(0.0, leaves[i])
        except LookupError as e:
            raise TrainingOpError(f"{label}: cannot build the zero gradient of "
                                  f"{leaves[i]!r}: {e}") from None
    return finals


def _name_outputs(gnode: NodeProto, finals: dict[int, str], em: Emitter, forward: _Forward,
                  prefix: str, meta: dict[str, ValueMeta]) -> None:
    """Give each gradient the node's output name: a gradient computed by one node of ours
    that nothing else reads (and no other output takes) is renamed; others get an Identity
    (one node less per parameter on every step)."""
    producer = {o: n for n in em.nodes for o in n.output if o}
    read = {name for n in em.nodes for name in n.input} | {forward.y}
    outputs_taking = Counter(finals.values())
    for i, g in finals.items():
        out = gnode.output[i]
        node = producer.get(g)
        if node is not None and g not in read and outputs_taking[g] == 1 and not _subgraph_reads(em.nodes, g):
            node.output[list(node.output).index(g)] = out
        else:
            em.add_node(helper.make_node("Identity", [g], [out], name=f"{prefix}output_{i}"))
        meta[out] = meta.get(forward.leaves[i], ValueMeta())


def expand_node(gnode: NodeProto, index: int, nodes: list[NodeProto], scope: Scope,
                 visible: frozenset | None = None) -> list[NodeProto]:
    """The nodes replacing the Gradient node ``gnode`` (the ``index``-th expanded in its
    graph ``nodes``): the forward copies if any, then the backward pass."""
    req = _request(gnode, scope.meta, visible)
    producers = producer_map(nodes)
    _check_independent(req.label, nodes, producers, req.xs, req.zs, set(req.xs) | set(req.zs))
    prefix = _prefix(gnode, index, scope.taken)
    em = Emitter(prefix, scope.opset, scope.meta, scope.native)
    forward = _forward(req, gnode, nodes, producers, scope, prefix)
    grads = backprop(forward.nodes, forward.y, forward.leaves, forward.cut, em, scope.constants, req.label)
    finals = _final_gradients(gnode, grads, forward.leaves, em, req.label)
    _name_outputs(gnode, finals, em, forward, prefix, scope.meta)
    scope.taken.update(n.output[0] for n in em.nodes if n.output)
    scope.taken.update(n.output[0] for n in forward.copies if n.output)
    return forward.copies + em.nodes


def _subgraph_reads(nodes, name: str) -> bool:
    """Whether a subgraph of ``nodes`` reads ``name`` from the enclosing scope."""
    for node in nodes:
        for attr in node.attribute:
            graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for g in graphs:
                if any(name in n.input for n in g.node) or _subgraph_reads(g.node, name):
                    return True
    return False
