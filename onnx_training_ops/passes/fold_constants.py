"""Pass: nodes whose inputs are all constant become constants, and nodes nothing reads go.

With the data inputs' shapes fixed, :func:`.fold_static_shapes` turns Shape and Size into
constants; this pass folds what reads them (the int64 arithmetic of a gradient: Gather,
Concat, Div, Unsqueeze, Range, Equal, Where... on shapes) and drops the nodes left unread, so
the graph an execution provider gets does no shape arithmetic at run time. It computes each
node with ``onnx.reference`` (numpy), never with onnxruntime: an onnxruntime CPU session over a
whole step refuses a bfloat16 node (no CPU kernel) and runs a float16 one in float32 between
casts it inserts, which its optimized model keeps.

Only small values are folded (a folded value is stored in the graph), and nothing of 16 bits
(numpy rounds float16 math differently from a GPU and has no bfloat16): those nodes stay for
the execution provider.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ..walk import all_graphs, subgraphs
from ._rewrite import constants, opset
from .fold_static_shapes import fold_static_shapes

MAX_ELEMENTS = 1 << 20
"""The largest value folded (elements): shape arithmetic and masks, never a big tensor."""

_SIXTEEN_BITS = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
_NOT_FOLDED = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
               "Bernoulli", "Dropout", "If", "Loop", "Scan", "SequenceEmpty", "Constant"}


def _sixteen_bit(value: np.ndarray) -> bool:
    return value.dtype == np.float16 or value.dtype.name == "bfloat16"


def _evaluate(node: onnx.NodeProto, version: int, inputs: list[np.ndarray | None]) -> list[np.ndarray] | None:
    """The node's outputs by onnx.reference, or None when it cannot compute them."""
    from onnx.reference import ReferenceEvaluator

    names = [name or "" for name in node.input]
    feeds = {name: value for name, value in zip(names, inputs) if name}
    try:
        outputs = ReferenceEvaluator(node, opsets={"": version}).run(None, feeds)
    except Exception:  # an op or case onnx.reference lacks: onnxruntime computes it
        return None
    return [np.asarray(o) for o in outputs]


def _foldable(node: onnx.NodeProto, known: dict[str, np.ndarray]) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type in _NOT_FOLDED:
        return False
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    present = [name for name in node.input if name]
    return all(name in known for name in present) and not any(_sixteen_bit(known[name]) for name in present)


def fold_constant_nodes(model: ModelProto, max_elements: int = MAX_ELEMENTS) -> int:
    """Replace each main-graph node whose inputs are constant by Constant nodes of its outputs
    (in place). Returns how many nodes were folded."""
    graph, version = model.graph, opset(model)
    known = constants(graph)
    nodes, folded = [], 0
    for node in graph.node:
        if not _foldable(node, known):
            nodes.append(node)
            continue
        outputs = _evaluate(node, version, [known.get(name) if name else None for name in node.input])
        if outputs is None or any(o.size > max_elements or _sixteen_bit(o) or o.dtype == object for o in outputs):
            nodes.append(node)
            continue
        for name, value in zip(node.output, outputs):
            if name:
                known[name] = value
                nodes.append(helper.make_node("Constant", [], [name], name=f"{name}/folded",  # unique, as values are
                                              value=numpy_helper.from_array(value, name)))
        folded += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return folded


def _read_names(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    """Every name the nodes read, what their subgraphs' nodes read included."""
    names: set[str] = set()
    for node in nodes:
        names.update(node.input)
        for sub in subgraphs(node):
            for g in all_graphs(sub):
                names.update(name for inner in g.node for name in inner.input)
    names.discard("")
    return names


def drop_unread(model: ModelProto) -> int:
    """Remove the main graph's nodes whose outputs nothing reads (no node, no graph output)
    and the initializers nothing reads (in place). Returns how many nodes went."""
    graph = model.graph
    wanted = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(name and name in wanted for name in node.output):
            kept.append(node)
            wanted |= _read_names([node])
    removed = len(graph.node) - len(kept)
    if removed:
        kept.reverse()
        del graph.node[:]
        graph.node.extend(kept)
    inputs = {vi.name for vi in graph.input}
    unread = [t for t in graph.initializer if t.name not in wanted and t.name not in inputs]
    if unread:
        names = {t.name for t in unread}
        keep = [t for t in graph.initializer if t.name not in names]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return removed


def fold_constants(model: ModelProto, max_elements: int = MAX_ELEMENTS, rounds: int = 8) -> ModelProto:
    """Fold the shape arithmetic of a model whose data inputs have static shapes (in place):
    Shape/Size/NonZero (:func:`.fold_static_shapes`), then every node computable from constants
    (:func:`fold_constant_nodes`), then the unread nodes dropped; again while anything folds
    (a Reshape to a folded shape gives shape inference a static shape to fold the next Shape).

    Returns:
        ``model``.
    """
    for _ in range(rounds):
        before = len(model.graph.node)
        counts = _constant_count(model)
        fold_static_shapes(model)
        folded = fold_constant_nodes(model, max_elements)
        drop_unread(model)
        if not folded and len(model.graph.node) == before and _constant_count(model) == counts:
            break
    return model


def _constant_count(model: ModelProto) -> int:
    return sum(n.op_type == "Constant" for n in model.graph.node)
