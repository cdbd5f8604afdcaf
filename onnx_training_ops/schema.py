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

    def tensor_count(self, node: onnx.NodeProto) -> int:
        """:meth:`n_tensors` of a node already checked (prepare's validation); a ValueError naming a malformed one."""
        n = self.n_tensors(len(node.input))
        if n is None:
            raise ValueError(f"{self.op_type} node {node.name!r}: {len(node.input)} inputs are not R, T and "
                                  f"whole groups of {', '.join(self.tensor_inputs)}")
        return n

    def all_attribute_names(self) -> tuple[str, ...]:
        return self.float_attributes + self.string_attributes


def _attribute_value(attr: AttributeProto):
    return onnx.helper.get_attribute_value(attr)


def _spec(op_type: str, tensor_inputs, tensor_outputs) -> OptimizerSpec:
    schema = onnx.defs.get_schema(op_type, OPSET_VERSION, DOMAIN)
    defaults: dict[str, float | str] = {}
    required, floats, strings = [], [], []
    for name, attr in sorted(schema.attributes.items()):
        if attr.type == onnx.defs.OpSchema.AttrType.FLOAT:
            floats.append(name)
        elif attr.type == onnx.defs.OpSchema.AttrType.STRING:
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


def _register_onnxruntime_onnx_domain_ops() -> None:
    """Make ``onnx.checker`` accept ``SimplifiedLayerNormalization``: onnxruntime registers this
    RMSNorm in the ONNX domain itself (version 1) and onnxruntime-genai's model builder writes it
    there, but onnx has no schema for it, so every check of a genai graph (the training step's
    concatenated graph, the exports) failed with "No Op registered". The schema mirrors
    onnxruntime's (inputs X, scale; outputs Y, optional inv_std_var; axis -1, epsilon 1e-5,
    stash_type 1); onnx's own, should a later onnx add one, wins."""
    name = "SimplifiedLayerNormalization"
    if onnx.defs.has(name):
        return
    schema_cls = onnx.defs.OpSchema
    param, optional = schema_cls.FormalParameter, schema_cls.FormalParameterOption.Optional
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    attrs = [schema_cls.Attribute(key, onnx.helper.make_attribute(key, value), "")
             for key, value in (("axis", -1), ("epsilon", 1e-5), ("stash_type", 1))]
    onnx.defs.register_schema(schema_cls(
        name, "", 1, "onnxruntime's RMSNorm (SimplifiedLayerNormalization, registered by onnx-training-ops)",
        inputs=[param("X", "T"), param("scale", "V")],
        outputs=[param("Y", "V"), param("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(double)"], ""), ("V", floats, "")],
        attributes=attrs))


_register_onnxruntime_onnx_domain_ops()
