"""Reductions beyond ReduceSum/ReduceMean: Max, Min, L1, L2, LogSumExp, SumSquare, Prod.

Each rule brings the output gradient (and the output) back to keepdims form, so it
broadcasts against ``x``, then multiplies by the local slope. ReduceMax/ReduceMin split the
gradient evenly among tied maxima, as ``torch.amax``/``amin`` do.
"""

from __future__ import annotations

from .registry import RuleContext, register
from .rules_shape import reduce_axes


def _keepdims(ctx: RuleContext, name: str) -> str:
    """``name`` (shaped like the output) with the reduced axes restored as size 1."""
    axes, _ = reduce_axes(ctx, attr_form=ctx.opset < 18)
    if bool(ctx.attr("keepdims", 1)):
        return name
    if axes is None:  # all axes: the output is a scalar
        axes = list(range(ctx.rank(ctx.node.input[0])))
    return ctx.em.unsqueeze(name, axes)


def _is_identity(ctx: RuleContext) -> bool:
    axes, noop = reduce_axes(ctx, attr_form=ctx.opset < 18)
    return axes is None and noop


def _reduce_rule(slope):
    """A rule dx = g_keep * slope(ctx, x, y_keep)."""

    def rule(ctx: RuleContext) -> list:
        rest = [None] * (len(ctx.node.input) - 1)
        if _is_identity(ctx):
            return [ctx.dy] + rest
        em, x = ctx.em, ctx.node.input[0]
        g, y = _keepdims(ctx, ctx.dy), _keepdims(ctx, ctx.y)
        return [em.op("Expand", [slope(ctx, x, y, g), em.shape_of(x)], "expand")] + rest

    return rule


def _extreme(ctx: RuleContext, x: str, y: str, g: str) -> str:
    em = ctx.em
    hit = em.cast_like(em.op("Equal", [x, y]), x)
    axes, _ = reduce_axes(ctx, attr_form=ctx.opset < 18)
    axes = list(range(ctx.rank(x))) if axes is None else axes
    count = em.reduce_sum(hit, axes, keepdims=True)
    return em.op("Mul", [hit, em.op("Div", [g, count])])


def _l1(ctx, x, y, g):
    return ctx.em.op("Mul", [g, ctx.em.op("Sign", [x])])


def _l2(ctx, x, y, g):
    return ctx.em.op("Mul", [g, ctx.em.op("Div", [x, y])])


def _log_sum_exp(ctx, x, y, g):
    return ctx.em.op("Mul", [g, ctx.em.op("Exp", [ctx.em.op("Sub", [x, y])])])


def _sum_square(ctx, x, y, g):
    em = ctx.em
    return em.op("Mul", [g, em.op("Add", [x, x])])


def _prod(ctx, x, y, g):
    return ctx.em.op("Mul", [g, ctx.em.op("Div", [y, x])])


register("ReduceMax", "ReduceMin")(_reduce_rule(_extreme))
register("ReduceL1")(_reduce_rule(_l1))
register("ReduceL2")(_reduce_rule(_l2))
register("ReduceLogSumExp")(_reduce_rule(_log_sum_exp))
register("ReduceSumSquare")(_reduce_rule(_sum_square))
register("ReduceProd")(_reduce_rule(_prod))
