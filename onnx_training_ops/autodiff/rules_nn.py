"""Neural-network ops: Softmax/LogSoftmax, Dropout (inference), MaxPool, AveragePool,
BatchNormalization (inference). Pooling reuses the window helpers of :mod:`.rules_conv`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import helper, numpy_helper

from .registry import RuleContext, RuleError, register
from .rules_conv import _input_grad, _is_zero, _kernel, _pads, _spatial, _window
from .rules_norm import BATCH_STATISTICS_DOC, batch_norm_batch_statistics


# ----------------------------------------------------------------------- softmax family
def _softmax_axis(ctx: RuleContext) -> int:
    return int(ctx.attr("axis", -1 if ctx.opset >= 13 else 1))


def _coerced(ctx: RuleContext, names: Sequence[str]) -> tuple[list[str], int]:
    """Before opset 13 Softmax works on the input flattened to 2-D at ``axis``."""
    if ctx.opset >= 13:
        return list(names), _softmax_axis(ctx)
    axis = _softmax_axis(ctx)
    return [ctx.em.op("Flatten", [n], axis=axis) for n in names], 1


@register("Softmax")
def _softmax(ctx: RuleContext) -> list:
    """dx = y * (g - sum(g * y, axis))."""
    em = ctx.em
    (g, y), axis = _coerced(ctx, [ctx.dy, ctx.y])
    dot = em.reduce_sum(em.op("Mul", [g, y]), [axis], keepdims=True)
    dx = em.op("Mul", [y, em.op("Sub", [g, dot])])
    return [dx if ctx.opset >= 13 else em.reshape_like(dx, ctx.node.input[0])]


@register("LogSoftmax")
def _log_softmax(ctx: RuleContext) -> list:
    """dx = g - exp(y) * sum(g, axis)."""
    em = ctx.em
    (g, y), axis = _coerced(ctx, [ctx.dy, ctx.y])
    total = em.reduce_sum(g, [axis], keepdims=True)
    dx = em.op("Sub", [g, em.op("Mul", [em.op("Exp", [y]), total])])
    return [dx if ctx.opset >= 13 else em.reshape_like(dx, ctx.node.input[0])]


@register("Dropout")
def _dropout(ctx: RuleContext) -> list:
    """Inference-mode Dropout is the identity; training mode is not differentiated."""
    mode = ctx.input(2)
    if mode is not None:
        value = ctx.const_value(mode)
        if value is None or bool(np.asarray(value).reshape(-1)[0]):
            raise RuleError("Dropout in training mode (training_mode not a constant false) "
                            "has no derivative rule")
    return [ctx.dy] + [None] * (len(ctx.node.input) - 1)



# ----------------------------------------------------------------------- pooling
@register("MaxPool")
def _max_pool(ctx: RuleContext) -> list:
    """Scatter-add the gradient to the arg-max positions given by MaxPool's Indices."""
    if ctx.opset < 16:
        raise RuleError("the MaxPool gradient needs ScatterElements reduction='add' "
                        f"(opset >= 16), graph has opset {ctx.opset}")
    em, g, x = ctx.em, ctx.dy, ctx.node.input[0]
    indices = ctx.output(1)
    if indices is None or int(ctx.attr("storage_order", 0)) != 0:
        outs = [em.fresh("maxpool"), em.fresh("argmax")]
        node = helper.make_node("MaxPool", [x], outs, name=outs[0])
        node.attribute.extend(a for a in ctx.node.attribute if a.name != "storage_order")
        em.add_node(node)
        indices = outs[1]
    dt = em.dtype(x)
    if dt is None:
        raise RuleError(f"element type of {x!r} unknown")
    size = em.op("Reshape", [em.op("Size", [x]), em.ints([1])])
    zeros = em.op("ConstantOfShape", [size], "zeros", value=numpy_helper.from_array(
        np.zeros(1, dtype=helper.tensor_dtype_to_np_dtype(dt))))
    flat_idx = em.op("Reshape", [indices, em.ints([-1])])
    flat_g = em.op("Reshape", [g, em.ints([-1])])
    dx = em.op("ScatterElements", [zeros, flat_idx, flat_g], "scatter", axis=0,
               reduction="add")
    return [em.reshape_like(dx, x)]


@register("AveragePool")
def _average_pool(ctx: RuleContext) -> list:
    """AveragePool is a depthwise convolution with a ones kernel, divided by the window
    count: the kernel size, or (count_include_pad=0) the number of non-pad elements, itself
    a Conv of ones over ones."""
    if int(ctx.attr("ceil_mode", 0)):
        raise RuleError("AveragePool with ceil_mode=1 has no derivative rule")
    if ctx.opset < 11:
        raise RuleError(f"the AveragePool gradient needs opset >= 11 (graph has {ctx.opset})")
    em, g, x, y = ctx.em, ctx.dy, ctx.node.input[0], ctx.y
    kernel = _kernel(ctx, None)
    n = len(kernel)
    strides, dilations = _window(ctx, n)
    pb, pe = _pads(ctx, x, kernel, strides, dilations)
    assert isinstance(kernel, list), "without a weight, _kernel reads the attribute or raises"
    dt = em.dtype(x)
    if dt is None:
        raise RuleError(f"element type of {x!r} unknown")
    np_dt = helper.tensor_dtype_to_np_dtype(dt)
    ones_w = em.const(np.ones([1, 1] + kernel, dtype=np_dt), "ones_kernel")
    if int(ctx.attr("count_include_pad", 0)) or (_is_zero(pb) and _is_zero(pe)):
        divisor = em.scalar(float(np.prod(kernel)), x)
    else:
        ones_x = em.op("ConstantOfShape", [em.op("Concat", [em.ints([1, 1]), em.dims_of(x, 2)],
                                                 axis=0)],
                       "ones", value=numpy_helper.from_array(np.ones(1, dtype=np_dt)))
        attrs = {a.name: helper.get_attribute_value(a) for a in ctx.node.attribute
                 if a.name in ("auto_pad", "pads", "strides", "dilations")}
        divisor = em.op("Conv", [ones_x, ones_w], "count", **attrs)
    g_r = em.op("Reshape", [g, em.op("Concat", [em.ints([-1, 1]), em.dims_of(y, 2)], axis=0)])
    g_r = em.op("Div", [g_r, divisor])
    dx = _input_grad(em, g_r, ones_w, x, _spatial(em, y), kernel, strides, dilations, 1, pb, pe)
    return [em.reshape_like(dx, x)]


# ----------------------------------------------------------------------- batch norm
@register("BatchNormalization", frozen=(3, 4))  # running mean, variance: statistics
def _batch_norm(ctx: RuleContext) -> list:
    """Inference-mode BatchNormalization, ``y = scale (x - mean) / sqrt(var + eps) + B``
    per channel (axis 1). Gradients for x, scale, B, and (if asked) mean and var. On batch
    statistics (``training_mode=1`` at opset >= 14, or the builder's mode="train" node):
    :func:`.rules_norm.batch_norm_batch_statistics`."""
    if (int(ctx.attr("training_mode", 0)) and ctx.opset >= 14) or ctx.node.doc_string == BATCH_STATISTICS_DOC:
        return batch_norm_batch_statistics(ctx)
    if int(ctx.attr("training_mode", 0)) or ctx.opset < 9:
        raise RuleError("only inference-mode BatchNormalization (training_mode=0, opset >= 9) "
                        "or training_mode=1 at opset >= 14 has a derivative rule")
    em, g = ctx.em, ctx.dy
    x, scale, bias, mean, var = ctx.node.input[:5]
    r = ctx.rank(x)
    other = [0] + list(range(2, r))

    def per_channel(v: str) -> str:  # [C] -> [1, C, 1, ...]
        return em.unsqueeze(v, other)

    eps = em.scalar(float(ctx.attr("epsilon", 1e-5)), var)
    inv_std = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, eps])])])
    out = ctx.empty()
    if ctx.need(0):
        out[0] = em.op("Mul", [g, per_channel(em.op("Mul", [scale, inv_std]))])
    gsum = em.reduce_sum(g, other, keepdims=False) if (ctx.need(2) or ctx.need(3)) else None
    if ctx.need(2):
        out[2] = gsum
    if ctx.need(1) or ctx.need(4):
        centered = em.op("Sub", [x, per_channel(mean)])
        s1 = em.reduce_sum(em.op("Mul", [g, centered]), other, keepdims=False)
        if ctx.need(1):
            out[1] = em.op("Mul", [s1, inv_std])
        if ctx.need(4):
            cube = em.op("Mul", [inv_std, em.op("Mul", [inv_std, inv_std])])
            half = em.op("Mul", [em.op("Mul", [s1, scale]), em.scalar(-0.5, var)])
            out[4] = em.op("Mul", [half, cube])
    if gsum is not None and ctx.need(3):
        out[3] = em.op("Neg", [em.op("Mul", [gsum, em.op("Mul", [scale, inv_std])])])
    return out
