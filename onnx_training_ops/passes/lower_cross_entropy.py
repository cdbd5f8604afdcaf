"""Pass: ``SoftmaxCrossEntropyLoss`` over ``[N, C]`` scores -> a few standard ops.

onnxruntime has no CPU kernel for the op and runs its function body, about 17 nodes
(Reshape, GatherElements, Slice, Where...) for the common classifier loss: on a small model
that is a fifth of a training step. For 2-D scores with a static class count, no ``weights``
and reduction ``mean`` or ``sum``, this pass writes the same loss as::

    log_prob = LogSoftmax(scores, axis=1)
    hot      = OneHot(labels, C)        # ignore_index first mapped to C when in [-C, C): a row of zeros
    loss     = -ReduceSum(hot * log_prob) [/ ReduceSum(hot)]   # mean over kept labels

or, past ``GATHER_FORM_CLASSES`` classes (a language model's vocabulary: a one-hot as big as
the logits), from each row's label column: ``-ReduceSum(GatherElements(log_prob, label) *
kept)`` [/ ``ReduceSum(kept)``].

(``log_prob`` keeps its name: the gradient reads it; the gradient rule writes ``hot`` and the
count with the same nodes, which onnxruntime's common-subexpression elimination merges).
Other forms are left to onnxruntime.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from ..autodiff.rules_loss import gathers_labels, ignore_needs_mapping, label_columns
from ._graph import value_types

_INT_LABELS = {6: np.int32, 7: np.int64}


def lower_cross_entropy(model: ModelProto) -> ModelProto:
    graph = model.graph
    nodes = [n for n in graph.node if n.op_type == "SoftmaxCrossEntropyLoss" and n.domain in ("", "ai.onnx")]
    if not nodes:
        return model
    types = value_types(model)
    taken = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer} | \
        {i.name for i in graph.input}
    counter = [0]

    def fresh(base: str) -> str:
        while True:
            counter[0] += 1
            name = f"{base}/lowered_{counter[0]}"
            if name not in taken:
                taken.add(name)
                return name

    replaced = {}
    for node in nodes:
        lowered = _lowered(node, types, fresh)
        if lowered is not None:
            replaced[id(node)] = lowered
    if not replaced:
        return model
    new_nodes = []
    for node in graph.node:
        new_nodes += replaced.get(id(node), [node])
    del graph.node[:]
    graph.node.extend(new_nodes)
    return model


def _lowered(node, types, fresh) -> list | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if len(node.input) > 2 and node.input[2] or reduction not in ("mean", "sum"):
        return None
    scores, labels = node.input[0], node.input[1]
    st, lt = types.get(scores), types.get(labels)
    if st is None or lt is None or st.shape is None or len(st.shape) != 2 or \
            not isinstance(st.shape[1], int) or lt.elem_type not in _INT_LABELS:
        return None
    classes, dtype = st.shape[1], helper.tensor_dtype_to_np_dtype(st.elem_type)
    label_dtype = _INT_LABELS[lt.elem_type]
    prefix = node.name or node.output[0]

    def const(value, dt, base):
        name = fresh(f"{prefix}/{base}")
        return name, helper.make_node("Constant", [], [name], name=name,
                                      value=numpy_helper.from_array(np.asarray(value, dt)))

    out = []
    log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else fresh(f"{prefix}/log_prob")
    out.append(helper.make_node("LogSoftmax", [scores], [log_prob], axis=1, name=fresh(f"{prefix}/LogSoftmax")))
    if gathers_labels(classes):
        return out + _gathered(prefix, labels, label_dtype, log_prob, node.output[0], attrs.get("ignore_index"),
                               reduction, dtype, fresh)
    index = labels
    if ignore_needs_mapping(attrs.get("ignore_index"), classes):
        ignore, n1 = const(attrs["ignore_index"], label_dtype, "ignore_index")
        past, n2 = const(classes, label_dtype, "classes")
        ignored, kept = fresh(f"{prefix}/ignored"), fresh(f"{prefix}/index")
        out += [n1, n2, helper.make_node("Equal", [labels, ignore], [ignored], name=ignored),
                helper.make_node("Where", [ignored, past, labels], [kept], name=kept)]
        index = kept
    if label_dtype is not np.int64:  # onnxruntime's OneHot: int64 indices, float values
        wide = fresh(f"{prefix}/index64")
        out.append(helper.make_node("Cast", [index], [wide], to=7, name=wide))
        index = wide
    depth, n3 = const([classes], np.int64, "depth")
    values, n4 = const([0, 1], np.float32, "values")
    hot, product, total = fresh(f"{prefix}/one_hot"), fresh(f"{prefix}/picked"), fresh(f"{prefix}/total")
    out += [n3, n4, helper.make_node("OneHot", [index, depth, values], [hot], axis=-1, name=hot)]
    if dtype != np.float32:
        cast = fresh(f"{prefix}/one_hot_cast")
        out.append(helper.make_node("Cast", [hot], [cast], to=helper.np_dtype_to_tensor_dtype(dtype), name=cast))
        hot = cast
    out += [helper.make_node("Mul", [hot, log_prob], [product], name=product),
            helper.make_node("ReduceSum", [product], [total], keepdims=0, name=total)]
    loss = node.output[0]
    if reduction == "sum":
        out.append(helper.make_node("Neg", [total], [loss], name=fresh(f"{prefix}/Neg")))
        return out
    negative, count = fresh(f"{prefix}/negative"), fresh(f"{prefix}/count")
    out += [helper.make_node("Neg", [total], [negative], name=negative),
            helper.make_node("ReduceSum", [hot], [count], keepdims=0, name=count),
            helper.make_node("Div", [negative, count], [loss], name=fresh(f"{prefix}/Div"))]
    return out


def _gathered(prefix, labels, label_dtype, log_prob, loss, ignore, reduction, dtype, fresh) -> list:
    """The loss from each row's label column: ``-sum(kept * log_prob[i, label_i])`` [/ count]
    (:func:`~onnx_training_ops.autodiff.rules_loss.label_columns`, as the gradient rule)."""
    nodes = []

    def op(op_type, inputs, **attrs):
        name = fresh(f"{prefix}/{op_type}")
        nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def const(value, dt):
        return op("Constant", [], value=numpy_helper.from_array(np.asarray(value, dt)))

    if label_dtype is not np.int64:
        labels = op("Cast", [labels], to=7)
    index, kept = label_columns(op, const, labels, ignore, dtype)
    picked = op("GatherElements", [log_prob, index], axis=1)
    if kept is not None:
        picked = op("Mul", [picked, kept])
    total = op("Neg", [op("ReduceSum", [picked], keepdims=0)])
    if reduction == "sum":
        nodes.append(helper.make_node("Identity", [total], [loss], name=fresh(f"{prefix}/loss")))
        return nodes
    count = op("ReduceSum", [kept], keepdims=0) if kept is not None else \
        op("CastLike", [op("Size", [labels]), total])
    nodes.append(helper.make_node("Div", [total, count], [loss], name=fresh(f"{prefix}/Div")))
    return nodes
