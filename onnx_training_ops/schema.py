"""What the ONNX schema says about the training ops: layouts, defaults, required attributes.

Everything here is read from ``onnx.defs`` at import time so it follows the installed
onnx; only the per-tensor input/output layout (which the schema states in prose) is
spelled out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import AttributeProto

DOMAIN = "ai.onnx.preview.training"
"""The ONNX training domain: Adam, Momentum, Adagrad and Gradient, opset version 1."""
OPSET_VERSION = 1


@dataclass(frozen=True)
class OptimizerSpec:
    """The layout and attributes of one optimizer op of the training domain."""

    op_type: str
    tensor_inputs: tuple[str, ...]  # per optimized tensor, in group order: X, G, V[, H]
    tensor_outputs: tuple[str, ...]  # per optimized tensor, in group order: X_new, V_new[, H_new]
    defaults: Mapping[str, float | str]  # attribute -> default (from onnx.defs)
    required: tuple[str, ...]  # attributes without a default
    float_attributes: tuple[str, ...]
    string_attributes: tuple[str, ...]

    @property
    def n_groups_in(self) -> int:
        return len(self.tensor_inputs)

    @property
    def n_groups_out(self) -> int:
        return len(self.tensor_outputs)

    @property
    def updated_inputs(self) -> tuple[str, ...]:
        """The input role each output group holds the new value of, in output order (X, V[, H])."""
        return tuple(role for role in self.tensor_inputs if role != "G")

    def n_tensors(self, n_inputs: int) -> int | None:
        """Number of optimized tensors for a node with ``n_inputs`` inputs, or None if invalid."""
        rest = n_inputs - 2
        if rest <= 0 or rest % self.n_groups_in:
            return None
        return rest // self.n_groups_in

    def all_attribute_names(self) -> tuple[str, ...]:
        return self.float_attributes + self.string_attributes


def _attribute_value(attr: AttributeProto):
    return onnx.helper.get_attribute_value(attr)


def _spec(op_type: str, tensor_inputs, tensor_outputs) -> OptimizerSpec:
    schema = onnx.defs.get_schema(op_type, OPSET_VERSION, DOMAIN)
    defaults: dict[str, float | str] = {}
    required, floats, strings = [], [], []
    for name, attr in sorted(schema.attributes.items()):
        if attr.type == AttributeProto.FLOAT:
            floats.append(name)
        elif attr.type == AttributeProto.STRING:
            strings.append(name)
        if attr.required:
            required.append(name)
        elif attr.default_value.type != AttributeProto.UNDEFINED:
            value = _attribute_value(attr.default_value)
            defaults[name] = value.decode() if isinstance(value, bytes) else value
    assert tuple(tensor_outputs) == tuple(f"{r}_new" for r in tensor_inputs if r != "G"), op_type
    return OptimizerSpec(
        op_type, tuple(tensor_inputs), tuple(tensor_outputs), defaults,
        tuple(required), tuple(floats), tuple(strings),
    )


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "Adam": _spec("Adam", ("X", "G", "V", "H"), ("X_new", "V_new", "H_new")),
    "Momentum": _spec("Momentum", ("X", "G", "V"), ("X_new", "V_new")),
    "Adagrad": _spec("Adagrad", ("X", "G", "H"), ("X_new", "H_new")),
}
MOMENTUM_MODES = ("standard", "nesterov")
TRAINING_OPS = (*OPTIMIZERS, "Gradient")
