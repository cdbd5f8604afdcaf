"""Neural-network ops: Softmax/LogSoftmax, Dropout (inference), Conv, MaxPool, AveragePool.

Convolution gradients are written with the forward op's own adjoints:

* dX: ``ConvTranspose`` of the output gradient with W (no padding) gives the gradient with
  respect to the *padded* input, short of the trailing rows no window touched; it is padded
  with zeros to the padded length and the interior (``[pad_begin, pad_begin + X)``) sliced.
* dW: a ``Conv`` whose input is X (padded, with batch and channel axes swapped, grouped
  channels folded into the batch) and whose kernel is the output gradient; stride and
  dilation trade places, and the result is sliced to the kernel size.

Pads come from ``pads`` or ``auto_pad``; for ``SAME_*`` with unknown spatial dims they are
computed at run time from ``Shape``.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
from onnx import helper, numpy_helper

from .emitter import Emitter, static_dims
from .registry import RuleContext, RuleError, register

Ints = Union[list, str]  # a static list of ints or the name of a 1-D int64 tensor


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
    (g, y), axis = _coerced(ctx, [ctx.grad(0), ctx.output(0)])
    dot = em.reduce_sum(em.op("Mul", [g, y]), [axis], keepdims=True)
    dx = em.op("Mul", [y, em.op("Sub", [g, dot])])
    return [dx if ctx.opset >= 13 else em.reshape_like(dx, ctx.node.input[0])]


@register("LogSoftmax")
def _log_softmax(ctx: RuleContext) -> list:
    """dx = g - exp(y) * sum(g, axis)."""
    em = ctx.em
    (g, y), axis = _coerced(ctx, [ctx.grad(0), ctx.output(0)])
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
    return [ctx.grad(0)] + [None] * (len(ctx.node.input) - 1)


# ----------------------------------------------------------------------- helpers
def _const_or_tensor(em: Emitter, v: Ints) -> str:
    return v if isinstance(v, str) else em.ints(v)


def _binary(em: Emitter, op: str, a: Ints, b: Ints) -> Ints:
    """Element-wise int arithmetic, folded when both sides are static."""
    if isinstance(a, list) and isinstance(b, list):
        f = {"Add": lambda p, q: p + q, "Sub": lambda p, q: p - q}[op]
        return [f(p, q) for p, q in zip(a, b)]
    return em.op(op, [_const_or_tensor(em, a), _const_or_tensor(em, b)], "dims")


def _is_zero(v: Ints) -> bool:
    return isinstance(v, list) and not any(v)


def _window(ctx: RuleContext, n: int) -> tuple[list, list]:
    strides = list(ctx.attr("strides") or [1] * n)
    dilations = list(ctx.attr("dilations") or [1] * n)
    return strides, dilations


def _pads(ctx: RuleContext, x: str, kernel: Ints, strides, dilations) -> tuple[Ints, Ints]:
    """Begin and end pads of the spatial axes (static lists, or tensors for dynamic SAME)."""
    n = len(strides)
    auto_pad = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad == "NOTSET":
        pads = list(ctx.attr("pads") or [0] * (2 * n))
        return pads[:n], pads[n:]
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    upper = auto_pad == "SAME_UPPER"
    em = ctx.em
    if isinstance(kernel, list):
        extent: Ints = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    else:
        scaled = em.op("Mul", [em.op("Sub", [kernel, em.ints([1] * n)]), em.ints(dilations)])
        extent = em.op("Add", [scaled, em.ints([1] * n)])
    s = ctx.shape(x)
    sp = static_dims(s[2:]) if s is not None else None
    if sp is not None and isinstance(extent, list):
        pb, pe = [], []
        for size, st, ext in zip(sp, strides, extent):
            out = -(-size // st)
            total = max(0, (out - 1) * st + ext - size)
            b = total // 2 if upper else total - total // 2
            pb.append(b)
            pe.append(total - b)
        return pb, pe
    size = em.dims_of(x, 2)
    st = em.ints(strides)
    out = em.op("Div", [em.op("Add", [size, em.ints([v - 1 for v in strides])]), st])
    span = em.op("Add", [em.op("Mul", [em.op("Sub", [out, em.ints([1] * n)]), st]),
                         _const_or_tensor(em, extent)])
    total = em.op("Max", [em.op("Sub", [span, size]), em.ints([0] * n)])
    half = em.op("Div", [total, em.ints([2] * n)])
    pb = half if upper else em.op("Sub", [total, half])
    return pb, em.op("Sub", [total, pb])


def _pad_tensor(em: Emitter, begin: Ints, end: Ints) -> str:
    """Pad's ``pads`` input for [N, C, spatial...]: nothing on N and C."""
    if isinstance(begin, list) and isinstance(end, list):
        return em.ints([0, 0] + begin + [0, 0] + end)
    return em.op("Concat", [em.ints([0, 0]), _const_or_tensor(em, begin),
                            em.ints([0, 0]), _const_or_tensor(em, end)], "pads", axis=0)


def _spatial(em: Emitter, name: str) -> Ints:
    s = em.shape(name)
    sp = static_dims(s[2:]) if s is not None else None
    return list(sp) if sp is not None else em.dims_of(name, 2)


def _input_grad(em: Emitter, g: str, w: str, x: str, y_spatial: Ints, kernel, strides,
                dilations, group: int, pb: Ints, pe: Ints) -> str:
    """Gradient of a (grouped) convolution with respect to its input ``x``."""
    n = len(strides)
    full = em.op("ConvTranspose", [g, w], "convT", strides=strides, dilations=dilations,
                 group=group)
    x_sp = _spatial(em, name=x)
    padded_len = _binary(em, "Add", _binary(em, "Add", x_sp, pb), pe)
    if isinstance(y_spatial, list) and isinstance(kernel, list):
        full_len: Ints = [st * (o - 1) + d * (k - 1) + 1
                          for o, st, d, k in zip(y_spatial, strides, dilations, kernel)]
    else:
        full_len = em.dims_of(full, 2)
    missing = _binary(em, "Sub", padded_len, full_len)
    if not _is_zero(missing):
        full = em.op("Pad", [full, _pad_tensor(em, [0] * n, missing)], "pad")
    if _is_zero(pb) and _is_zero(pe):
        return full
    ends = _binary(em, "Add", pb, x_sp)
    axes = em.ints(list(range(2, 2 + n)))
    return em.op("Slice", [full, _const_or_tensor(em, pb), _const_or_tensor(em, ends), axes],
                 "slice")


def _kernel(ctx: RuleContext, w: str | None) -> Ints:
    """Kernel spatial dims: static (attribute or known weight shape) or ``Shape(w)[2:]``."""
    kernel = ctx.attr("kernel_shape")
    if kernel:
        return list(kernel)
    s = ctx.shape(w) if w else None
    dims = static_dims(s[2:]) if s is not None else None
    if dims is not None:
        return list(dims)
    if w is None:
        raise RuleError("needs kernel_shape")
    return ctx.em.dims_of(w, 2)


def _swap01(em: Emitter, x: str, rank: int) -> str:
    return em.op("Transpose", [x], perm=[1, 0] + list(range(2, rank)))


# ----------------------------------------------------------------------- Conv
@register("Conv")
def _conv(ctx: RuleContext) -> list:
    if ctx.opset < 11:
        raise RuleError(f"the Conv gradient needs opset >= 11 (graph has {ctx.opset})")
    em, g = ctx.em, ctx.grad(0)
    x, w = ctx.node.input[:2]
    kernel = _kernel(ctx, w)
    n = len(kernel) if isinstance(kernel, list) else ctx.rank(x) - 2
    strides, dilations = _window(ctx, n)
    group = int(ctx.attr("group", 1))
    pb, pe = _pads(ctx, x, kernel, strides, dilations)
    out = ctx.empty()
    if ctx.need(0):
        out[0] = _input_grad(em, g, w, x, _spatial(em, ctx.output(0)), kernel, strides,
                             dilations, group, pb, pe)
    if ctx.need(1):
        xp = x if _is_zero(pb) and _is_zero(pe) else em.op("Pad", [x, _pad_tensor(em, pb, pe)])
        if group == 1:
            xt = _swap01(em, xp, n + 2)
        else:
            ws = ctx.shape(w)
            cg = [ws[1]] if ws is not None and isinstance(ws[1], int) else None
            cg_t = em.ints(cg) if cg else em.dims_of(w, 1, 2)
            folded = em.op("Reshape", [xp, em.op("Concat", [em.ints([0, group]), cg_t,
                                                            em.ints([-1])], axis=0)])
            moved = em.op("Transpose", [folded], perm=[2, 1, 0, 3])
            target = em.op("Concat", [cg_t, em.ints([-1]), em.dims_of(xp, 2)], axis=0)
            xt = em.op("Reshape", [moved, target])
        gt = _swap01(em, g, n + 2)
        dw = em.op("Conv", [xt, gt], "convW", strides=dilations, dilations=strides, group=group)
        dw = em.op("Slice", [dw, em.ints([0] * n), _const_or_tensor(em, kernel),
                             em.ints(list(range(2, 2 + n)))], "slice")
        out[1] = _swap01(em, dw, n + 2)
    if ctx.need(2):
        out[2] = em.reduce_sum(g, [0] + list(range(2, 2 + n)), keepdims=False)
    return out


# ----------------------------------------------------------------------- pooling
@register("MaxPool")
def _max_pool(ctx: RuleContext) -> list:
    """Scatter-add the gradient to the arg-max positions given by MaxPool's Indices."""
    if ctx.opset < 16:
        raise RuleError("the MaxPool gradient needs ScatterElements reduction='add' "
                        f"(opset >= 16), graph has opset {ctx.opset}")
    em, g, x = ctx.em, ctx.grad(0), ctx.node.input[0]
    if ctx.output(1) and int(ctx.attr("storage_order", 0)) == 0:
        indices = ctx.output(1)
    else:
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
    em, g, x, y = ctx.em, ctx.grad(0), ctx.node.input[0], ctx.output(0)
    kernel = _kernel(ctx, None)
    n = len(kernel)
    strides, dilations = _window(ctx, n)
    pb, pe = _pads(ctx, x, kernel, strides, dilations)
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
@register("BatchNormalization")
def _batch_norm(ctx: RuleContext) -> list:
    """Inference-mode BatchNormalization, ``y = scale (x - mean) / sqrt(var + eps) + B``
    per channel (axis 1). Gradients for x, scale, B, and (if asked) mean and var."""
    if int(ctx.attr("training_mode", 0)) or ctx.opset < 9:
        raise RuleError("only inference-mode BatchNormalization (training_mode=0, opset >= 9) "
                        "has a derivative rule")
    em, g = ctx.em, ctx.grad(0)
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
    if ctx.need(3):
        out[3] = em.op("Neg", [em.op("Mul", [gsum, em.op("Mul", [scale, inv_std])])])
    return out
