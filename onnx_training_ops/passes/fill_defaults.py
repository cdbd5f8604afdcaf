"""Pass: give every optimizer node each attribute its schema defaults (the kernels need them all)."""

from __future__ import annotations

import onnx
from onnx import ModelProto

from ..schema import OPTIMIZERS
from ._graph import model_training_nodes


def fill_default_attributes(model: ModelProto) -> ModelProto:
    """Add the schema's default for every attribute a node leaves out (in place; returns model)."""
    for _, node in model_training_nodes(model):
        spec = OPTIMIZERS.get(node.op_type)
        if spec is None:
            continue
        present = {a.name for a in node.attribute}
        for name, value in spec.defaults.items():
            if name not in present:
                node.attribute.append(onnx.helper.make_attribute(name, value))
    return model
