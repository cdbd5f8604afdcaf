"""What every optimizer's lowering to standard ops shares: fresh names, folded constants, R and T.

Each optimizer module's ``lower(s, attributes, label)`` emits its per-node scalars through a
:class:`NodeScalars` and returns the function that writes one tensor's update
(:class:`LoweredTensor` in, the values of X_new and the new states out, in the op's output
order). :mod:`onnx_training_ops.passes.lower_optimizers` walks the graphs and calls them.

Rounding, as the reference kernels: scalars (R, T and what is computed from them) in float64,
then one Cast to the tensors' dtype; attribute constants (``alpha``, ``1-alpha``, ...) folded
here in float64 from the float32 values the model holds, then rounded to the tensors' dtype,
as numpy does with a Python float times a float32 array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

FLOAT_TYPES: dict[int, type[np.floating]] = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


class Emitter:
    """Emits the ops of one graph's lowered nodes: fresh names, shared constants.

    ``unique_name(taken, base)`` picks a name not in ``taken`` and adds it there."""

    def __init__(self, taken: set[str], opset: int, unique_name: Callable[[set[str], str], str]) -> None:
        self.taken = taken
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._constants: dict[tuple, str] = {}
        self._unique_name = unique_name

    def name(self, base: str) -> str:
        return self._unique_name(self.taken, base)

    def op(self, op_type: str, inputs: list[str], base: str, **attrs) -> str:
        out = self.name(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(f"{base}/{op_type}"), **attrs))
        return out

    def const(self, value: float, elem_type: int, base: str) -> str:
        key = (elem_type, float(value) if elem_type != TensorProto.INT64 else int(value), base)
        if key not in self._constants:
            name = self.name(base)
            if elem_type == TensorProto.INT64:
                tensor = helper.make_tensor(name, elem_type, [0], [])  # an empty shape: Reshape to []
            else:
                tensor = onnx.numpy_helper.from_array(np.array(value, FLOAT_TYPES[elem_type]), name)
            self.nodes.append(helper.make_node("Constant", [], [name], name=self.name(f"{name}/Constant"),
                                               value=tensor))
            self._constants[key] = name
        return self._constants[key]


class NodeScalars:
    """The per-node scalars: R and T as float64 scalars, and their use in one tensor dtype.

    ``types`` maps a value name to an object with a ``shape`` (tuple, None when unknown)."""

    def __init__(self, e: Emitter, node: onnx.NodeProto, types: Mapping[str, Any], base: str) -> None:
        self.e, self.base = e, base
        self.r = e.op("Cast", [self._scalar(node.input[0], types)], f"{base}/R_f64", to=TensorProto.DOUBLE)
        self.t = e.op("Cast", [self._scalar(node.input[1], types)], f"{base}/T_f64", to=TensorProto.DOUBLE)
        self._positive: str | None = None
        self._in: dict[tuple[str, int | str], str] = {}

    def _scalar(self, name: str, types: Mapping[str, Any]) -> str:
        vt = types.get(name)
        if vt is not None and vt.shape == ():
            return name
        empty = self.e.const(0, TensorProto.INT64, "portable/scalar_shape")
        return self.e.op("Reshape", [name, empty], f"{self.base}/{name}_scalar")

    def f64(self, value: float, what: str) -> str:
        return self.e.const(value, TensorProto.DOUBLE, f"portable/{what}_f64")

    def positive(self) -> str:
        """T > 0 (the spec's first step has T = 0)."""
        if self._positive is None:
            self._positive = self.e.op("Greater", [self.t, self.f64(0.0, "zero")], f"{self.base}/T_positive")
        return self._positive

    def as_dtype(self, value: str, dtype: int | str, what: str) -> str:
        """A float64 scalar in the tensors' dtype (``dtype`` an elem type, or a value to CastLike)."""
        key = (value, dtype)
        if key not in self._in:
            if isinstance(dtype, str):
                self._in[key] = self.e.op("CastLike", [value, dtype], f"{self.base}/{what}")
            else:
                self._in[key] = self.e.op("Cast", [value], f"{self.base}/{what}", to=dtype)
        return self._in[key]


def suffix(dtype: int | str) -> str:
    """A name suffix for the tensors' dtype: f32, f64, or like_X when it is not known."""
    if isinstance(dtype, str):
        return f"like_{dtype}"
    return "f32" if dtype == TensorProto.FLOAT else "f64"


def constant(e: Emitter, value: float, dtype: int | str, what: str, base: str) -> str:
    """``value`` (a Python float, as the kernels hold it) in the tensors' dtype."""
    if isinstance(dtype, str):  # dtype unknown: CastLike a float64 constant to X
        return e.op("CastLike", [e.const(value, TensorProto.DOUBLE, f"portable/{what}_f64"), dtype], f"{base}/{what}")
    return e.const(value, dtype, f"portable/{what}_{suffix(dtype)}")


def scaled(e: Emitter, x: str, c: float, dtype, what: str, base: str) -> str:
    """``x * c`` for a computed constant ``c`` (``1 - attribute``), in the tensors' dtype.

    onnxruntime's NoopElimination drops ``Mul(x, c)`` when ``static_cast<float>(c) == 1``,
    also for a double ``c`` (1 - 6e-10 is 1 in float32): for float64 tensors such a ``c`` is
    applied as ``(x * 2) * (c / 2)``, the same rounded value (doubling and halving are exact;
    only |x| > 8.9e307 would overflow), which the rule leaves alone."""
    if dtype == TensorProto.DOUBLE and c != 1.0 and float(np.float32(c)) == 1.0:
        doubled = e.op("Mul", [x, e.const(2.0, dtype, "portable/two_f64")], f"{base}_doubled")
        return e.op("Mul", [doubled, constant(e, c / 2, dtype, f"half_{what}", base)], base)
    return e.op("Mul", [x, constant(e, c, dtype, what, base)], base)


@dataclass(frozen=True)
class LoweredTensor:
    """One optimized tensor of a node being lowered: its input names, dtype and name prefix.

    Attributes:
        e: the graph's emitter.
        s: the node's scalars.
        x: X's name.
        g: G's name.
        state: the state inputs' names, in the op's order (V, H for Adam).
        dtype: the TensorProto element type, or X's name when not known statically.
        base: the prefix of every emitted name.
        same_shape: G has X's static shape (so ``0 * X + G`` may be just G).
    """

    e: Emitter
    s: NodeScalars
    x: str
    g: str
    state: tuple[str, ...]
    dtype: int | str
    base: str
    same_shape: bool

    def k(self, value: float, what: str) -> str:
        """The constant ``value`` in the tensor's dtype."""
        return constant(self.e, value, self.dtype, what, self.base)

    def op(self, op_type: str, inputs: list[str], what: str, **attrs) -> str:
        """One op named ``<base>/<what>``."""
        return self.e.op(op_type, inputs, f"{self.base}/{what}", **attrs)

    def scaled(self, x: str, c: float, what: str, name: str) -> str:
        """``x * c`` for a computed constant (see :func:`scaled`), named ``<base>/<name>``."""
        return scaled(self.e, x, c, self.dtype, what, f"{self.base}/{name}")

    def in_dtype(self, value: str, what: str) -> str:
        """The node's float64 scalar ``value`` cast to the tensor's dtype (shared per dtype)."""
        return self.s.as_dtype(value, self.dtype, f"{what}_{suffix(self.dtype)}")

    def regularized(self, norm_coefficient: float) -> str:
        """``norm_coefficient * X + G`` (just G when the coefficient is 0 and G is X-shaped)."""
        if norm_coefficient == 0.0 and self.same_shape:
            return self.g
        nc_x = self.op("Mul", [self.x, self.k(norm_coefficient, "norm_coefficient")], "nc_x")
        return self.op("Add", [nc_x, self.g], "G_regularized")


# lower(s, attributes, label) -> the function writing one tensor's update
Lowering = Callable[[NodeScalars, dict, str], Callable[[LoweredTensor], list[str]]]
