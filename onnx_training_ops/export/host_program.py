"""The host program of a WebGPU step (:func:`~onnx_training_ops.passes.split_host_scalars.split_host_scalars`):
a few scalar ops, evaluated here as the JavaScript trainer evaluates them (float64 for
doubles, float32 rounding where the graph casts to float, int64 exact).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from onnx import helper

from ..errors import TrainingOpError

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Pow": np.power, "Max": np.maximum, "Min": np.minimum,
    "Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal, "LessOrEqual": np.less_equal,
    "Equal": np.equal, "And": np.logical_and, "Or": np.logical_or}
_UNARY: dict[str, Callable[[Any], Any]] = {
    "Sqrt": np.sqrt, "Neg": np.negative, "Abs": np.abs, "Exp": np.exp, "Log": np.log, "Floor": np.floor,
    "Ceil": np.ceil, "Not": np.logical_not, "Identity": lambda x: x, "Reciprocal": lambda x: (np.ones_like(x) / x)}


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)
    return a / b


def run(program: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Evaluate ``program`` on ``inputs`` (name -> scalar array).

    Args:
        program: the host program (``split_host_scalars``'s second result).
        inputs: a value for each of its ``inputs``.

    Returns:
        Every value it computes, by name (its ``outputs`` and ``feeds`` among them).

    Raises:
        TrainingOpError: a missing input or an op it does not know.
    """
    values: dict[str, np.ndarray] = {}
    for name in program["inputs"]:
        if name not in inputs:
            raise TrainingOpError(f"host program: no value for input {name!r}")
        values[name] = np.asarray(inputs[name])
    for name, c in program["constants"].items():
        values[name] = np.asarray(c["values"], dtype=c["dtype"]).reshape(c["shape"])
    for node in program["nodes"]:
        args = [values[i] for i in node["inputs"]]
        op = node["op"]
        if op in _BINARY:
            result = args[0]
            for arg in args[1:]:  # Max and Min take any number of inputs
                result = _BINARY[op](result, arg)
            if op in ("Add", "Sub", "Mul", "Pow", "Max", "Min"):
                result = np.asarray(result).astype(args[0].dtype)
        elif op == "Div":
            result = _div(args[0], args[1])
        elif op in _UNARY:
            result = np.asarray(_UNARY[op](args[0])).astype(args[0].dtype)
        elif op == "Where":
            result = np.where(args[0], args[1], args[2])
        elif op == "Cast":
            result = args[0].astype(helper.tensor_dtype_to_np_dtype(node["attrs"]["to"]))
        else:
            raise TrainingOpError(f"host program: op {op} is not evaluated on the host")
        values[node["outputs"][0]] = np.asarray(result)
    return values
