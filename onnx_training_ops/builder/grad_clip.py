"""Gradient clipping as standard ONNX ops between the Gradient node and the optimizer nodes.

* :func:`clip_by_global_norm` is ``torch.nn.utils.clip_grad_norm_(params, max_norm)``: the
  L2 norm of every gradient's L2 norm, ``coef = min(max_norm / (norm + 1e-6), 1)``, every
  gradient times ``coef``; the norm before clipping is an output (what torch returns).
* :func:`clip_by_value` is ``torch.nn.utils.clip_grad_value_(params, clip_value)``:
  ``Clip(g, -v, v)``.

Every runtime applies them (no custom op). Under gradient accumulation they act on the
accumulated gradient, as torch's do when called after the last ``backward()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import TrainingOpError

EPSILON = 1e-6  # torch's clip_grad_norm_


def checked_limit(name: str, value) -> float | None:
    """``value`` as a positive finite float, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not np.isfinite(value) or value <= 0:
        raise TrainingOpError(f"{name} must be a finite number > 0, found {value!r}")
    return float(value)


def _const(nodes: list, name: Callable[[str], str], base: str, value, dtype) -> str:
    out = name(base)
    nodes.append(helper.make_node("Constant", [], [out], name=out,
                                  value=numpy_helper.from_array(np.array(value, dtype))))
    return out


def clip_by_value(grads: Sequence[str], dtypes: Sequence[np.dtype], clip_value: float,
                  name: Callable[[str], str]) -> tuple[list[onnx.NodeProto], list[str]]:
    """(nodes, clipped gradient names)."""
    nodes: list[onnx.NodeProto] = []
    out = []
    bounds: dict[np.dtype, tuple[str, str]] = {}
    for g, dtype in zip(grads, dtypes):
        if dtype not in bounds:
            bounds[dtype] = (_const(nodes, name, "clip_value.low", -clip_value, dtype),
                             _const(nodes, name, "clip_value.high", clip_value, dtype))
        clipped = name(f"{g}.clipped")
        nodes.append(helper.make_node("Clip", [g, *bounds[dtype]], [clipped], name=clipped))
        out.append(clipped)
    return nodes, out


def clip_by_global_norm(grads: Sequence[str], dtypes: Sequence[np.dtype], max_norm: float,
                        name: Callable[[str], str], norm_name: str
                        ) -> tuple[list[onnx.NodeProto], list[str]]:
    """(nodes, clipped gradient names); ``norm_name`` is the total norm (in the first
    gradient's dtype, as torch's ``torch.stack`` of the per-tensor norms)."""
    nodes: list[onnx.NodeProto] = []
    dtype = np.dtype(dtypes[0])
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    axis0 = _const(nodes, name, "clip_norm.axis0", [0], np.int64)
    norms = []
    for g, g_dtype in zip(grads, dtypes):
        norm = name(f"{g}.norm")
        nodes.append(helper.make_node("ReduceL2", [g], [norm], keepdims=0, name=norm))
        if np.dtype(g_dtype) != dtype:
            cast = name(f"{g}.norm.cast")
            nodes.append(helper.make_node("Cast", [norm], [cast], to=elem, name=cast))
            norm = cast
        one_d = name(f"{g}.norm.1d")
        nodes.append(helper.make_node("Unsqueeze", [norm, axis0], [one_d], name=one_d))
        norms.append(one_d)
    stacked = name("clip_norm.norms")
    nodes.append(helper.make_node("Concat", norms, [stacked], axis=0, name=stacked))
    nodes.append(helper.make_node("ReduceL2", [stacked], [norm_name], keepdims=0, name=norm_name))
    eps = _const(nodes, name, "clip_norm.eps", EPSILON, dtype)
    limit = _const(nodes, name, "clip_norm.max", max_norm, dtype)
    one = _const(nodes, name, "clip_norm.one", 1.0, dtype)
    denominator, ratio, coef = name("clip_norm.denominator"), name("clip_norm.ratio"), name("clip_norm.coef")
    nodes += [helper.make_node("Add", [norm_name, eps], [denominator], name=denominator),
              helper.make_node("Div", [limit, denominator], [ratio], name=ratio),
              helper.make_node("Min", [ratio, one], [coef], name=coef)]
    out = []
    coefs = {dtype: coef}
    for g, g_dtype in zip(grads, dtypes):
        g_dtype = np.dtype(g_dtype)
        if g_dtype not in coefs:
            cast = name(f"clip_norm.coef.{g_dtype.name}")
            nodes.append(helper.make_node("Cast", [coef], [cast], name=cast,
                                          to=helper.np_dtype_to_tensor_dtype(g_dtype)))
            coefs[g_dtype] = cast
        clipped = name(f"{g}.clipped")
        nodes.append(helper.make_node("Mul", [g, coefs[g_dtype]], [clipped], name=clipped))
        out.append(clipped)
    return nodes, out
