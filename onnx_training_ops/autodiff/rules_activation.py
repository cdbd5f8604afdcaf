"""Activations and the remaining element-wise math: Erf, Gelu, the hard/soft family, ELUs,
PRelu, Clip, Min/Max, Reciprocal, Sin/Cos.

Each rule writes the derivative with the forward output where that is cheaper. Piecewise
functions take torch's side at the kinks (``Clip`` passes the gradient at its bounds;
``Min``/``Max`` split it evenly between tied inputs, as ``torch.minimum``/``maximum`` do).
"""

from __future__ import annotations

import math

from .registry import RuleContext, RuleError, register

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875


def _where_positive(ctx: RuleContext, x: str, then: str, other: str) -> str:
    em = ctx.em
    return em.op("Where", [em.op("Greater", [x, em.scalar(0, x)]), then, other])


@register("Erf")
def _erf(ctx: RuleContext) -> list:
    """d erf(x) = 2/sqrt(pi) exp(-x^2)."""
    em, x = ctx.em, ctx.node.input[0]
    slope = em.op("Exp", [em.op("Neg", [em.op("Mul", [x, x])])])
    slope = em.op("Mul", [slope, em.scalar(2.0 / math.sqrt(math.pi), x)])
    return [em.op("Mul", [ctx.dy, slope])]


@register("Gelu", "com.microsoft::Gelu", "com.microsoft::FastGelu", "com.microsoft::BiasGelu")
def _gelu(ctx: RuleContext) -> list:
    """approximate="none": Phi(x) + x phi(x); "tanh": the derivative of the tanh form.
    onnxruntime's ``com.microsoft`` Gelu and FastGelu (what ``passes.fuse_gelu`` writes) are
    the same two forms; FastGelu's optional bias and BiasGelu's second input are added to x
    first (BiasGelu is the erf form)."""
    em, g = ctx.em, ctx.dy
    x = ctx.node.input[0]
    bias = ctx.input(1) if ctx.node.domain == "com.microsoft" else None
    if bias is not None:
        x = em.op("Add", [x, bias], "biased")
        em.set_meta(x, em.dtype(ctx.node.input[0]), ctx.shape(ctx.node.output[0]))
    tanh_form = ctx.node.op_type == "FastGelu" or ctx.attr("approximate", "none") == "tanh"
    half, one = em.scalar(0.5, x), em.scalar(1.0, x)
    if tanh_form:
        c = em.scalar(0.044715, x)
        x2 = em.op("Mul", [x, x])
        inner = em.op("Mul", [em.op("Add", [x, em.op("Mul", [c, em.op("Mul", [x2, x])])]),
                              em.scalar(SQRT_2_OVER_PI, x)])
        t = em.op("Tanh", [inner])
        d_inner = em.op("Mul", [em.op("Add", [one, em.op("Mul", [em.scalar(3 * 0.044715, x), x2])]),
                                em.scalar(SQRT_2_OVER_PI, x)])
        sech2 = em.op("Sub", [one, em.op("Mul", [t, t])])
        slope = em.op("Add", [em.op("Mul", [half, em.op("Add", [one, t])]),
                              em.op("Mul", [em.op("Mul", [half, x]), em.op("Mul", [sech2, d_inner])])])
    else:
        cdf = em.op("Mul", [half, em.op("Add", [one, em.op("Erf", [
            em.op("Mul", [x, em.scalar(1.0 / math.sqrt(2.0), x)])])])])
        pdf = em.op("Mul", [em.op("Exp", [em.op("Mul", [em.op("Mul", [x, x]), em.scalar(-0.5, x)])]),
                            em.scalar(1.0 / math.sqrt(2.0 * math.pi), x)])
        slope = em.op("Add", [cdf, em.op("Mul", [x, pdf])])
    dx = em.op("Mul", [g, slope])
    if bias is None:
        return [dx]
    return [dx if ctx.need(0) else None, ctx.unbroadcast(dx, bias) if ctx.need(1) else None]


@register("com.microsoft::QuickGelu")
def _quick_gelu(ctx: RuleContext) -> list:
    """``y = x sigmoid(alpha x)``: ``dy/dx = s + alpha x s (1 - s)``, s = sigmoid(alpha x)."""
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    alpha = em.scalar(float(ctx.attr("alpha", 1.702)), x)
    ax = em.op("Mul", [x, alpha])
    sig = em.op("Sigmoid", [ax])
    slope = em.op("Add", [sig, em.op("Mul", [em.op("Mul", [ax, sig]), em.op("Sub", [em.scalar(1.0, x), sig])])])
    return [em.op("Mul", [g, slope])]


def _inside(ctx: RuleContext, v: str, lo: float, hi: float) -> str:
    """A bool tensor: lo < v < hi."""
    em = ctx.em
    return em.op("And", [em.op("Greater", [v, em.scalar(lo, v)]), em.op("Less", [v, em.scalar(hi, v)])])


@register("HardSigmoid")
def _hard_sigmoid(ctx: RuleContext) -> list:
    """y = clip(alpha x + beta, 0, 1): slope alpha strictly inside, 0 outside."""
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    z = em.op("Add", [em.op("Mul", [x, em.scalar(alpha, x)]), em.scalar(beta, x)])
    return [em.op("Where", [_inside(ctx, z, 0.0, 1.0), em.op("Mul", [g, em.scalar(alpha, x)]),
                            em.scalar(0, x)])]


@register("HardSwish")
def _hard_swish(ctx: RuleContext) -> list:
    """y = x clip(x/6 + 1/2, 0, 1): 0 below -3, x/3 + 1/2 on [-3, 3], 1 above (torch's kinks)."""
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    mid = em.op("Add", [em.op("Mul", [x, em.scalar(1.0 / 3.0, x)]), em.scalar(0.5, x)])
    slope = em.op("Where", [em.op("Less", [x, em.scalar(-3.0, x)]), em.scalar(0, x),
                            em.op("Where", [em.op("LessOrEqual", [x, em.scalar(3.0, x)]), mid,
                                            em.scalar(1.0, x)])])
    return [em.op("Mul", [g, slope])]


@register("Softplus")
def _softplus(ctx: RuleContext) -> list:
    return [ctx.em.op("Mul", [ctx.dy, ctx.em.op("Sigmoid", [ctx.node.input[0]])])]


@register("Softsign")
def _softsign(ctx: RuleContext) -> list:
    """y = x / (1 + |x|): dy = 1 / (1 + |x|)^2."""
    em, x = ctx.em, ctx.node.input[0]
    d = em.op("Add", [em.scalar(1.0, x), em.op("Abs", [x])])
    return [em.op("Div", [ctx.dy, em.op("Mul", [d, d])])]


@register("Elu")
def _elu(ctx: RuleContext) -> list:
    """x > 0: 1; else y + alpha."""
    em, x, y, g = ctx.em, ctx.node.input[0], ctx.y, ctx.dy
    alpha = float(ctx.attr("alpha", 1.0))
    neg = em.op("Mul", [g, em.op("Add", [y, em.scalar(alpha, x)])])
    return [_where_positive(ctx, x, g, neg)]


@register("Selu")
def _selu(ctx: RuleContext) -> list:
    """x > 0: gamma; else y + gamma alpha."""
    em, x, y, g = ctx.em, ctx.node.input[0], ctx.y, ctx.dy
    alpha, gamma = float(ctx.attr("alpha", SELU_ALPHA)), float(ctx.attr("gamma", SELU_GAMMA))
    pos = em.op("Mul", [g, em.scalar(gamma, x)])
    neg = em.op("Mul", [g, em.op("Add", [y, em.scalar(gamma * alpha, x)])])
    return [_where_positive(ctx, x, pos, neg)]


@register("Celu")
def _celu(ctx: RuleContext) -> list:
    """x > 0: 1; else exp(x / alpha)."""
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    alpha = float(ctx.attr("alpha", 1.0))
    neg = em.op("Mul", [g, em.op("Exp", [em.op("Mul", [x, em.scalar(1.0 / alpha, x)])])])
    return [_where_positive(ctx, x, g, neg)]


@register("Mish")
def _mish(ctx: RuleContext) -> list:
    """y = x tanh(softplus(x)): tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x)."""
    em, x = ctx.em, ctx.node.input[0]
    t = em.op("Tanh", [em.op("Softplus", [x])])
    sech2 = em.op("Sub", [em.scalar(1.0, x), em.op("Mul", [t, t])])
    slope = em.op("Add", [t, em.op("Mul", [x, em.op("Mul", [sech2, em.op("Sigmoid", [x])])])])
    return [em.op("Mul", [ctx.dy, slope])]


@register("PRelu")
def _prelu(ctx: RuleContext) -> list:
    """y = x (x > 0) or slope x: dx = g or g slope; dslope = g x where x <= 0."""
    em, g = ctx.em, ctx.dy
    x, slope = ctx.node.input[:2]
    positive = em.op("Greater", [x, em.scalar(0, x)])
    out = ctx.empty()
    if ctx.need(0):
        out[0] = em.op("Where", [positive, g, em.op("Mul", [g, slope])])
    if ctx.need(1):
        gs = em.op("Where", [positive, em.scalar(0, x), em.op("Mul", [g, x])])
        out[1] = ctx.unbroadcast(gs, slope)
    return out


@register("ThresholdedRelu")
def _thresholded_relu(ctx: RuleContext) -> list:
    em, x = ctx.em, ctx.node.input[0]
    above = em.op("Greater", [x, em.scalar(float(ctx.attr("alpha", 1.0)), x)])
    return [em.op("Where", [above, ctx.dy, em.scalar(0, x)])]


@register("Clip")
def _clip(ctx: RuleContext) -> list:
    """Passes g where min <= x <= max (torch.clamp); a bound input gets g where it clipped."""
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    zero = em.scalar(0, x)
    if ctx.opset < 11:
        raise RuleError("Clip before opset 11 (min/max attributes) has no derivative rule; "
                        "convert the model to opset >= 13")
    lo, hi = ctx.input(1), ctx.input(2)
    out = ctx.empty()
    keep = None
    if lo is not None:
        below = em.op("Less", [x, lo])
        keep = em.op("Not", [below])
        if ctx.need(1):
            out[1] = em.reduce_sum(em.op("Where", [below, g, zero]), list(range(ctx.rank(x))),
                                   keepdims=False)
    if hi is not None:
        above = em.op("Greater", [x, hi])
        not_above = em.op("Not", [above])
        keep = not_above if keep is None else em.op("And", [keep, not_above])
        if ctx.need(2):
            if lo is not None:  # where min > max the result is max
                above = em.op("Or", [above, em.op("Greater", [lo, hi])])
            out[2] = em.reduce_sum(em.op("Where", [above, g, zero]), list(range(ctx.rank(x))),
                                   keepdims=False)
    if ctx.need(0):
        out[0] = g if keep is None else em.op("Where", [keep, g, zero])
    return out


@register("Max", "Min")
def _max_min(ctx: RuleContext) -> list:
    """Each input that attains the result gets g / (number of inputs attaining it)."""
    em, g, y = ctx.em, ctx.dy, ctx.y
    inputs = list(ctx.node.input)
    hits = [em.cast_like(em.op("Equal", [x, y]), y) for x in inputs]
    count = hits[0] if len(hits) == 1 else em.op("Sum", hits)
    share = em.op("Div", [g, count])
    return [ctx.unbroadcast(em.op("Mul", [share, h]), x) if ctx.need(i) else None
            for i, (x, h) in enumerate(zip(inputs, hits))]


@register("Reciprocal")
def _reciprocal(ctx: RuleContext) -> list:
    em, y = ctx.em, ctx.y
    return [em.op("Neg", [em.op("Mul", [ctx.dy, em.op("Mul", [y, y])])])]


@register("Sin")
def _sin(ctx: RuleContext) -> list:
    return [ctx.em.op("Mul", [ctx.dy, ctx.em.op("Cos", [ctx.node.input[0]])])]


@register("Cos")
def _cos(ctx: RuleContext) -> list:
    em = ctx.em
    return [em.op("Neg", [em.op("Mul", [ctx.dy, em.op("Sin", [ctx.node.input[0]])])])]
