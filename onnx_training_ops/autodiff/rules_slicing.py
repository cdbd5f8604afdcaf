"""Slicing and layout ops: Split, Slice, Pad, Tile, Trilu, CumSum.

A unit-step Slice with known bounds is padded back (:func:`pad_back`: one Pad, no index
tensor). Other slices, Pad and Tile use the index-map adjoint of :mod:`.rules_indexing` (the
op run on the input's element numbers tells where each output element came from), so every
form of the op (negative steps, clamped ends, edge/reflect padding, opset-specific inputs)
is handled by the op's own kernel.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from .registry import RuleContext, RuleError, register
from .rules_indexing import element_numbers, moved_elements, scatter_back


@register("Split")
def _split(ctx: RuleContext) -> list:
    """Concatenate the output gradients (zeros for outputs that got none)."""
    em = ctx.em
    axis = int(ctx.attr("axis", 0))
    parts = [ctx.grad(i) or em.filled_like(0.0, out) for i, out in enumerate(ctx.node.output)]
    return [em.op("Concat", parts, "concat", axis=axis)] + [None] * (len(ctx.node.input) - 1)


def pad_back(em, g: str, rank: int, before: dict[int, int], after: dict[int, int]) -> str:
    """``g`` placed back into zeros: ``before[a]``/``after[a]`` zeros on axis ``a`` (the
    adjoint of a contiguous slice: one Pad, no index tensor)."""
    pads = [before.get(a, 0) for a in range(rank)] + [after.get(a, 0) for a in range(rank)]
    if not any(pads):
        return g
    if em.opset < 11:
        return em.op("Pad", [g], "pad", pads=pads)
    return em.op("Pad", [g, em.ints(pads)], "pad")


def slice_bounds(ctx: RuleContext) -> tuple[dict[int, int], dict[int, int]] | None:
    """The zeros before and after a unit-step Slice's window on each sliced axis, when its
    starts/ends/axes/steps are constants and the sliced dims static; else None."""
    x = ctx.node.input[0]
    shape = ctx.shape(x)
    values = [ctx.const_value(ctx.input(i)) for i in range(1, 5)]
    if shape is None or values[0] is None or values[1] is None or any(
            ctx.input(i) is not None and values[i - 1] is None for i in (3, 4)):
        return None
    starts, ends = (np.asarray(v).reshape(-1).tolist() for v in values[:2])
    rank = len(shape)
    axes = np.asarray(values[2]).reshape(-1).tolist() if values[2] is not None else list(range(len(starts)))
    steps = np.asarray(values[3]).reshape(-1).tolist() if values[3] is not None else [1] * len(starts)
    before, after = {}, {}
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = axis + rank if axis < 0 else axis
        dim = shape[axis]
        if step != 1 or not isinstance(dim, int):
            return None
        start = min(max(start + dim if start < 0 else start, 0), dim)
        end = min(max(end + dim if end < 0 else end, 0), dim)
        if end <= start:
            return None  # empty window: the index-map fallback handles it
        before[axis], after[axis] = start, dim - end
    return before, after


@register("Slice")
def _slice(ctx: RuleContext) -> list:
    """A unit-step window with known bounds: the gradient padded back with zeros (one Pad).
    Other slices (steps, dynamic bounds or dims): the index-map scatter."""
    if ctx.opset < 10:
        raise RuleError("Slice before opset 10 (starts/ends attributes) has no derivative rule")
    rest = [None] * (len(ctx.node.input) - 1)
    bounds = slice_bounds(ctx)
    if bounds is not None:
        return [pad_back(ctx.em, ctx.dy, ctx.rank(ctx.node.input[0]), *bounds)] + rest
    return [moved_elements(ctx, add=False)] + rest


@register("Tile")
def _tile(ctx: RuleContext) -> list:
    return [moved_elements(ctx, add=True), None]


@register("Pad")
def _pad(ctx: RuleContext) -> list:
    """constant: the interior; edge/reflect: every output element folds back onto its source.
    A float constant_value input gets the sum of the gradient over the padding."""
    if ctx.opset < 11:
        raise RuleError("Pad before opset 11 (pads attribute) has no derivative rule")
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    mode = ctx.attr("mode", "constant")
    pads, axes = ctx.input(1), ctx.input(3)
    if pads is None:
        raise RuleError("Pad without its pads input")
    numbers = element_numbers(em, x)
    fill = em.const(np.int64(-1)) if mode == "constant" else ""
    inputs = [numbers, pads, fill] + ([axes] if axes else [])
    source = em.fresh("Pad_source")
    em.add_node(helper.make_node("Pad", inputs, [source], name=source, mode=mode))
    out = ctx.empty()
    if mode != "constant":
        out[0] = scatter_back(em, x, source, g, add=True)
        return out
    valid = em.op("GreaterOrEqual", [source, em.const(np.int64(0))])
    if ctx.need(0):
        out[0] = scatter_back(em, x, source, g, add=False, valid=valid)
    if ctx.need(2):
        padding = em.op("Where", [valid, em.scalar(0, x), g])
        out[2] = em.reduce_sum(padding, list(range(ctx.rank(x))), keepdims=False)
    return out


@register("Trilu")
def _trilu(ctx: RuleContext) -> list:
    """The same triangle of the gradient."""
    em = ctx.em
    inputs = [ctx.dy] + list(ctx.node.input[1:])
    return [em.op("Trilu", inputs, "trilu", upper=int(ctx.attr("upper", 1)))] + \
        [None] * (len(ctx.node.input) - 1)


@register("CumSum")
def _cumsum(ctx: RuleContext) -> list:
    """The cumulative sum of the gradient in the other direction."""
    em = ctx.em
    reverse = 1 - int(ctx.attr("reverse", 0))
    dx = em.op("CumSum", [ctx.dy, ctx.node.input[1]], "cumsum",
               exclusive=int(ctx.attr("exclusive", 0)), reverse=reverse)
    return [dx, None]
