"""Indexing ops: GatherElements, GatherND, ScatterND, ScatterElements — and the index-map
adjoint that data-movement rules share.

**Index maps.** An op that only moves, drops or repeats elements (Slice, Tile, GatherND,
GatherElements, Pad in edge/reflect mode, nearest Resize...) is linear with a 0/1 matrix.
Running the op itself on ``iota`` (``x``'s flat element numbers, shaped like ``x``) yields,
for every output element, the input element it came from. The gradient is then a
``ScatterND`` (``reduction="add"`` where an element may be used twice) of the output
gradient into zeros at those numbers. The op's own semantics (negative indices, clamping,
steps, batch_dims) are thus reused, never re-derived.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from .emitter import Emitter
from .registry import RuleContext, RuleError, register


def element_numbers(em: Emitter, x: str) -> str:
    """An int64 tensor shaped like ``x`` holding 0, 1, ..., size(x) - 1."""
    size = em.op("Size", [x], "size")
    flat = em.op("Range", [em.const(np.int64(0)), size, em.const(np.int64(1))], "iota")
    return em.op("Reshape", [flat, em.shape_of(x)], "iota")


def scatter_back(em: Emitter, x: str, source: str, g: str, add: bool = True,
                 valid: str | None = None) -> str:
    """Zeros shaped like ``x`` with ``g[i]`` added at flat position ``source[i]``.

    ``valid`` (bool, shaped like ``g``) drops the elements that came from no input element.
    """
    if em.opset < 16 and (add or valid is not None):
        raise RuleError(f"needs ScatterND reduction='add' (opset >= 16), graph has {em.opset}")
    dt = em.dtype(x)
    if dt is None:
        raise RuleError(f"element type of {x!r} unknown")
    if valid is not None:
        source = em.op("Where", [valid, source, em.const(np.int64(0))])
        g = em.op("Where", [valid, g, em.scalar(0, x)])
    size = em.op("Size", [x], "size")
    zeros = em.op("ConstantOfShape", [em.unsqueeze(size, [0])], "zeros",
                  value=numpy_helper.from_array(
                      np.zeros(1, dtype=helper.tensor_dtype_to_np_dtype(dt))))
    where = em.op("Reshape", [source, em.ints([-1, 1])], "where")
    values = em.op("Reshape", [g, em.ints([-1])], "values")
    # dropped elements all land on position 0 with value 0: only "add" keeps that harmless
    flat = em.op("ScatterND", [zeros, where, values], "scatter",
                 reduction="add" if add or valid is not None else None)
    return em.op("Reshape", [flat, em.shape_of(x)], "unflatten")


def moved_elements(ctx: RuleContext, add: bool = True) -> str:
    """Gradient of input 0 of the current node by its index map (same node on ``iota``)."""
    em, x = ctx.em, ctx.node.input[0]
    inputs = [element_numbers(em, x)] + list(ctx.node.input[1:])
    attrs = {a.name: a for a in ctx.node.attribute}
    source = em.fresh(f"{ctx.node.op_type}_source")
    node = helper.make_node(ctx.node.op_type, inputs, [source], name=source)
    node.attribute.extend(attrs.values())
    em.add_node(node)
    return scatter_back(em, x, source, ctx.dy, add=add)


@register("GatherElements")
def _gather_elements(ctx: RuleContext) -> list:
    return [moved_elements(ctx), None]


@register("GatherND")
def _gather_nd(ctx: RuleContext) -> list:
    return [moved_elements(ctx), None]


def _scatter_updates(ctx: RuleContext, gather_op: str, **attrs) -> list:
    """y = data with ``updates`` written at ``indices``: d data = g with those positions
    zeroed (when replaced), d updates = g gathered there."""
    em, g = ctx.em, ctx.dy
    data, indices, updates = ctx.node.input[:3]
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add"):
        raise RuleError(f"reduction={reduction!r} has no derivative rule (only none and add)")
    idx = indices if em.dtype(indices) == TensorProto.INT64 else em.op(
        "Cast", [indices], to=TensorProto.INT64)
    out = ctx.empty()
    if ctx.need(0):
        if reduction == "add":
            out[0] = g
        else:
            zeros = em.filled_like(0.0, updates)
            out[0] = em.op(ctx.node.op_type, [g, idx, zeros], "scatter", **attrs)
    if ctx.need(2):
        out[2] = em.op(gather_op, [g, idx], "gather", **attrs)
    return out


@register("ScatterND")
def _scatter_nd(ctx: RuleContext) -> list:
    return _scatter_updates(ctx, "GatherND")


@register("ScatterElements")
def _scatter_elements(ctx: RuleContext) -> list:
    return _scatter_updates(ctx, "GatherElements", axis=int(ctx.attr("axis", 0)))
