"""Pass: :mod:`.lower_cross_entropy` for the native path.

The one-hot form (float32 ``[N, C]`` scores, ``C <= GATHER_FORM_CLASSES``, int64 labels, no
weights, mean or sum) becomes two nodes::

    log_prob = LogSoftmax(scores, axis=1)      # onnxruntime's, shared with the gradient
    loss     = TrainingCrossEntropyLoss(log_prob, labels, config)

(:mod:`onnx_training_ops.kernels._native_grad_kernels`; ``config`` as the gradient rule
writes it, :func:`~onnx_training_ops.autodiff.rules_loss.cross_entropy_config`). Every other
form goes to :func:`.lower_cross_entropy`.
"""

from __future__ import annotations

from onnx import ModelProto, TensorProto, helper, numpy_helper

from ..autodiff.native_ops import CROSS_ENTROPY_LOSS, DOMAIN
from ..autodiff.rules_loss import cross_entropy_config, gathers_labels
from ._graph import unique_name, value_types
from .lower_cross_entropy import lower_cross_entropy


def lower_cross_entropy_native(model: ModelProto) -> ModelProto:
    graph = model.graph
    types = value_types(model) if any(n.op_type == "SoftmaxCrossEntropyLoss" for n in graph.node) else {}
    taken = {o for n in graph.node for o in n.output} | {t.name for t in graph.initializer} | \
        {i.name for i in graph.input}

    def fresh(base: str) -> str:
        return unique_name(taken, base)

    new_nodes, changed = [], False
    for node in graph.node:
        lowered = _native(node, types, fresh)
        changed |= lowered is not None
        new_nodes += lowered or [node]
    if changed:
        del graph.node[:]
        graph.node.extend(new_nodes)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return lower_cross_entropy(model)


def _native(node, types, fresh) -> list | None:
    if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    st, lt = types.get(node.input[0]), types.get(node.input[1])
    if len(node.input) > 2 and node.input[2] or reduction not in ("mean", "sum") or st is None or lt is None \
            or st.elem_type != TensorProto.FLOAT or lt.elem_type != TensorProto.INT64 or st.shape is None \
            or len(st.shape) != 2 or not isinstance(st.shape[1], int) or gathers_labels(st.shape[1]):
        return None
    prefix = node.name or node.output[0]
    log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else fresh(f"{prefix}/log_prob")
    config = fresh(f"{prefix}/config")
    value = numpy_helper.from_array(cross_entropy_config(reduction, attrs.get("ignore_index")))
    return [helper.make_node("LogSoftmax", [node.input[0]], [log_prob], axis=1, name=fresh(f"{prefix}/LogSoftmax")),
            helper.make_node("Constant", [], [config], name=config, value=value),
            helper.make_node(CROSS_ENTROPY_LOSS, [log_prob, node.input[1], config], [node.output[0]],
                             name=fresh(f"{prefix}/loss"), domain=DOMAIN)]
