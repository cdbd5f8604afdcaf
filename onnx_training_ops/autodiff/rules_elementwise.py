"""Element-wise ops: arithmetic with numpy broadcasting, unary math, activations, Cast.

Binary ops reduce each operand's gradient back to that operand's shape
(:meth:`Emitter.unbroadcast`). Unary rules use the forward output where it is cheaper
(``Exp``, ``Sigmoid``, ``Tanh``, ``Sqrt``).
"""

from __future__ import annotations

from onnx import TensorProto

from .native_ops import RELU_GRAD
from .registry import RuleContext, RuleError, register


@register("Identity")
def _identity(ctx: RuleContext) -> list:
    return [ctx.dy]


@register("Add", "Sub")
def _add_sub(ctx: RuleContext) -> list:
    g, (a, b) = ctx.dy, ctx.node.input[:2]
    out = ctx.empty()
    if ctx.need(0):
        out[0] = ctx.unbroadcast(g, a)
    if ctx.need(1):
        gb = g if ctx.node.op_type == "Add" else ctx.em.op("Neg", [g])
        out[1] = ctx.unbroadcast(gb, b)
    return out


@register("Mul")
def _mul(ctx: RuleContext) -> list:
    em, g, (a, b) = ctx.em, ctx.dy, ctx.node.input[:2]
    out = ctx.empty()
    if ctx.need(0):
        out[0] = ctx.unbroadcast(em.op("Mul", [g, b]), a)
    if ctx.need(1):
        out[1] = ctx.unbroadcast(em.op("Mul", [g, a]), b)
    return out


@register("Div")
def _div(ctx: RuleContext) -> list:
    """y = a / b: da = g / b, db = -g * y / b."""
    em, g, (a, b), y = ctx.em, ctx.dy, ctx.node.input[:2], ctx.y
    out = ctx.empty()
    g_over_b = em.op("Div", [g, b])
    if ctx.need(0):
        out[0] = ctx.unbroadcast(g_over_b, a)
    if ctx.need(1):
        out[1] = ctx.unbroadcast(em.op("Neg", [em.op("Mul", [g_over_b, y])]), b)
    return out


@register("Sum")
def _sum(ctx: RuleContext) -> list:
    return [ctx.unbroadcast(ctx.dy, x) if ctx.need(i) else None
            for i, x in enumerate(ctx.node.input)]


@register("Neg")
def _neg(ctx: RuleContext) -> list:
    return [ctx.em.op("Neg", [ctx.dy])]


@register("Pow")
def _pow(ctx: RuleContext) -> list:
    """y = a ** b: da = g * b * a ** (b - 1), db = g * y * log(a)."""
    em, g, (a, b), y = ctx.em, ctx.dy, ctx.node.input[:2], ctx.y
    out = ctx.empty()
    if ctx.need(0):
        b_minus_1 = em.op("Sub", [b, em.scalar(1, b)])
        slope = em.op("Mul", [em.cast_like(b, a), em.op("Pow", [a, b_minus_1])])
        out[0] = ctx.unbroadcast(em.op("Mul", [g, slope]), a)
    if ctx.need(1):
        gb = em.op("Mul", [em.op("Mul", [g, y]), em.op("Log", [a])])
        out[1] = ctx.unbroadcast(gb, b)
    return out


@register("Sqrt")
def _sqrt(ctx: RuleContext) -> list:
    em, y = ctx.em, ctx.y
    return [em.op("Div", [ctx.dy, em.op("Add", [y, y])])]


@register("Exp")
def _exp(ctx: RuleContext) -> list:
    return [ctx.em.op("Mul", [ctx.dy, ctx.y])]


@register("Log")
def _log(ctx: RuleContext) -> list:
    return [ctx.em.op("Div", [ctx.dy, ctx.node.input[0]])]


@register("Abs")
def _abs(ctx: RuleContext) -> list:
    em = ctx.em
    return [em.op("Mul", [ctx.dy, em.op("Sign", [ctx.node.input[0]])])]


@register("Relu")
def _relu(ctx: RuleContext) -> list:
    em, x = ctx.em, ctx.node.input[0]
    if ctx.output(0):  # y > 0 exactly where x > 0; reading y leaves x to a fused Gemm+Relu
        x = ctx.y  # (onnxruntime's Sign would do in one node less, but runs 2x slower)
    if RELU_GRAD in em.native and em.dtype(x) == TensorProto.FLOAT:  # the same product, one node
        return [em.native_op(RELU_GRAD, [ctx.dy, x], "drelu")]
    positive = em.op("Greater", [x, em.scalar(0, x)])
    try:  # g * (x > 0): a plain elementwise Mul, where onnxruntime's Where broadcasts slowly
        return [em.op("Mul", [ctx.dy, em.cast_like(positive, x)])]
    except LookupError:  # x's type unknown below opset 15
        return [em.op("Where", [positive, ctx.dy, em.scalar(0, x)])]


@register("LeakyRelu")
def _leaky_relu(ctx: RuleContext) -> list:
    em, x, g = ctx.em, ctx.node.input[0], ctx.dy
    alpha = float(ctx.attr("alpha", 0.01))
    positive = em.op("Greater", [x, em.scalar(0, x)])
    return [em.op("Where", [positive, g, em.op("Mul", [g, em.scalar(alpha, x)])])]


@register("Sigmoid")
def _sigmoid(ctx: RuleContext) -> list:
    """dy/dx = y (1 - y)."""
    em, y = ctx.em, ctx.y
    one_minus = em.op("Sub", [em.scalar(1, y), y])
    return [em.op("Mul", [ctx.dy, em.op("Mul", [y, one_minus])])]


@register("Tanh")
def _tanh(ctx: RuleContext) -> list:
    """dy/dx = 1 - y^2."""
    em, y = ctx.em, ctx.y
    one_minus = em.op("Sub", [em.scalar(1, y), em.op("Mul", [y, y])])
    return [em.op("Mul", [ctx.dy, one_minus])]


@register("Cast")
def _cast(ctx: RuleContext) -> list:
    """Only float-to-float casts carry a gradient (integer values are constants)."""
    try:
        return [ctx.em.cast_like(ctx.dy, ctx.node.input[0])]
    except LookupError as e:
        raise RuleError(str(e)) from None


@register("CastLike")
def _cast_like(ctx: RuleContext) -> list:
    """CastLike(x, like): the gradient goes back to x's type; ``like`` only gives a type."""
    x = ctx.node.input[0]
    return [ctx.em.op("CastLike", [ctx.dy, x], "cast"), None]


@register("Where")
def _where(ctx: RuleContext) -> list:
    em, g = ctx.em, ctx.dy
    cond, a, b = ctx.node.input[:3]
    out = ctx.empty()
    if ctx.need(1):
        out[1] = ctx.unbroadcast(em.op("Where", [cond, g, em.scalar(0, a)]), a)
    if ctx.need(2):
        out[2] = ctx.unbroadcast(em.op("Where", [cond, em.scalar(0, b), g]), b)
    return out


@register("Expand")
def _expand(ctx: RuleContext) -> list:
    return [ctx.unbroadcast(ctx.dy, ctx.node.input[0]), None]
