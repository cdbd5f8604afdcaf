"""Pass: point every optimizer node at the native kernels (:mod:`onnx_training_ops.runtime.native`).

``ai.onnx.preview.training::Adam`` becomes ``ai.onnx.contrib::TrainingAdam`` (likewise
Momentum and Adagrad), multi-tensor nodes stay whole (the native op is variadic), and
output names left empty get fresh names (the kernel writes every output). The spec
attributes stay; ``exact_attributes`` (read by the PyOp path only) is dropped.
"""

from __future__ import annotations

import onnx
from onnx import ModelProto

from ..autodiff import native_ops
from ..schema import DOMAIN, OPTIMIZERS
from ..walk import model_graphs
from ._graph import all_names, unique_name
from .encode_exact_attributes import EXACT_ATTRIBUTE

NATIVE_DOMAIN = native_ops.DOMAIN  # where onnxruntime-extensions registers external ops
NATIVE_OP_TYPES = {"Adam": "TrainingAdam", "Momentum": "TrainingMomentum", "Adagrad": "TrainingAdagrad"}


def target_native(model: ModelProto) -> ModelProto:
    """Rewrite the optimizer nodes of every graph for the native kernels (in place)."""
    graphs = list(model_graphs(model))
    taken: set[str] = set()
    for graph in graphs:
        taken |= all_names(graph)
    used = False
    for graph in graphs:
        for node in graph.node:
            spec = OPTIMIZERS.get(node.op_type) if node.domain == DOMAIN else None
            if spec is None:
                continue
            n = spec.n_tensors(len(node.input)) or 1
            outputs = list(node.output) + [""] * (n * spec.n_groups_out - len(node.output))
            base = node.name or node.output[0] or node.op_type
            for j, name in enumerate(outputs):
                if not name:
                    role = spec.tensor_outputs[j // n]
                    outputs[j] = unique_name(taken, f"{base}/{role}{j % n}_unused")
            del node.output[:]
            node.output.extend(outputs)
            kept = [a for a in node.attribute if a.name != EXACT_ATTRIBUTE]
            del node.attribute[:]
            node.attribute.extend(kept)
            node.op_type = NATIVE_OP_TYPES[node.op_type]
            node.domain = NATIVE_DOMAIN
            used = True
    if used and not any(o.domain == NATIVE_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(NATIVE_DOMAIN, 1))
    return model
