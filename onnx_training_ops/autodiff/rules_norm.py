"""Normalizations: LayerNormalization, GroupNormalization, InstanceNormalization, and the
global pools GlobalAveragePool / GlobalMaxPool.

All three normalizations are ``y = xhat * scale + bias`` with ``xhat = (x - mean) * inv``,
``inv = 1 / sqrt(var + eps)`` over some axes. Their input gradient is the one formula

    dx = inv * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),   dxhat = g * scale

(means over the normalized axes). The statistics are recomputed from ``x`` (a few reductions);
LayerNormalization on float32 reads them from its forward node's Mean and InvStdDev outputs,
named by the rule if the export left them out (onnxruntime computes them anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import TensorProto, helper

from .emitter import Emitter, static_dims
from .native_ops import BATCH_NORM_GRAD, DOMAIN
from .registry import RuleContext, RuleError, register


def reduce_mean(em: Emitter, x: str, axes: Sequence[int]) -> str:
    """ReduceMean with keepdims over static ``axes``, in the form the opset wants."""
    if em.opset >= 18:
        return em.op("ReduceMean", [x, em.ints(axes)], "rmean", keepdims=1)
    return em.op("ReduceMean", [x], "rmean", axes=list(axes), keepdims=1)


def statistics(em: Emitter, x: str, axes: Sequence[int], eps: float) -> tuple[str, str]:
    """(xhat, inv) of ``x`` normalized over ``axes`` (biased variance)."""
    centered = em.op("Sub", [x, reduce_mean(em, x, axes)])
    var = reduce_mean(em, em.op("Mul", [centered, centered]), axes)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [var, em.scalar(eps, x)])])])
    return em.op("Mul", [centered, inv]), inv


def normalized_input_grad(em: Emitter, dxhat: str, xhat: str, inv: str,
                          axes: Sequence[int]) -> str:
    """dx from dxhat through xhat = (x - mean) * inv (mean, var over ``axes``)."""
    m1 = reduce_mean(em, dxhat, axes)
    m2 = reduce_mean(em, em.op("Mul", [dxhat, xhat]), axes)
    inner = em.op("Sub", [em.op("Sub", [dxhat, m1]), em.op("Mul", [xhat, m2])])
    return em.op("Mul", [inv, inner])


def _check_float(ctx: RuleContext, x: str) -> None:
    if int(ctx.attr("stash_type", 1)) != 1:
        raise RuleError("only stash_type=1 (float32 statistics) is supported")


@register("LayerNormalization")
def _layer_norm(ctx: RuleContext) -> list:
    """Normalized over axes [axis, rank); Scale and B broadcast to those axes."""
    if any(ctx.grad(i) for i in (1, 2)):
        raise RuleError("gradients flowing into the Mean/InvStdDev outputs are not supported")
    em, g = ctx.em, ctx.dy
    _check_float(ctx, ctx.node.input[0])
    x, scale = ctx.node.input[:2]
    bias = ctx.input(2)
    r = ctx.rank(x)
    axis = int(ctx.attr("axis", -1))
    axes = list(range(axis + r if axis < 0 else axis, r))
    if em.dtype(x) == TensorProto.FLOAT:  # statistics of the forward node (float32, as x)
        mean, inv = ctx.name_output(1, "ln_mean"), ctx.name_output(2, "ln_inv_std")
        xhat = em.op("Mul", [em.op("Sub", [x, mean]), inv])
    else:
        xhat, inv = statistics(em, x, axes, float(ctx.attr("epsilon", 1e-5)))
    out = ctx.empty()
    if ctx.need(0):
        out[0] = normalized_input_grad(em, em.op("Mul", [g, scale]), xhat, inv, axes)
    if ctx.need(1):
        out[1] = ctx.unbroadcast(em.op("Mul", [g, xhat]), scale)
    if bias is not None and ctx.need(2):
        out[2] = ctx.unbroadcast(g, bias)
    return out


def _channel_stats_grad(ctx: RuleContext, x4: str, g4: str, scale_b: str, bias_b: str | None,
                        axes: Sequence[int], stats: tuple[str, str] | None = None
                        ) -> tuple[str | None, str | None, str | None]:
    """(dx4, dscale_b, dbias_b) for x4 normalized over ``axes``, scale/bias broadcast;
    ``stats``: (mean, variance) shaped for broadcasting, else recomputed from x4."""
    em = ctx.em
    eps = float(ctx.attr("epsilon", 1e-5))
    if stats is None:
        xhat, inv = statistics(em, x4, axes, eps)
    else:
        inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [stats[1], em.scalar(eps, x4)])])])
        xhat = em.op("Mul", [em.op("Sub", [x4, stats[0]]), inv])
    dx = normalized_input_grad(em, em.op("Mul", [g4, scale_b]), xhat, inv, axes) \
        if ctx.need(0) else None
    dscale = em.unbroadcast(em.op("Mul", [g4, xhat]), em.shape(x4), scale_b) \
        if ctx.need(1) else None
    dbias = em.unbroadcast(g4, em.shape(x4), bias_b) if bias_b is not None and ctx.need(2) \
        else None
    return dx, dscale, dbias


@register("InstanceNormalization")
def _instance_norm(ctx: RuleContext) -> list:
    """x [N, C, d...]: normalized over the spatial axes; scale, B of shape [C]."""
    em, g = ctx.em, ctx.dy
    x, scale, bias = ctx.node.input[:3]
    r = ctx.rank(x)
    if r < 3:
        raise RuleError(f"InstanceNormalization needs rank >= 3, {x!r} has rank {r}")
    spatial = list(range(2, r))
    scale_b = em.unsqueeze(scale, [0] + spatial)
    bias_b = em.unsqueeze(bias, [0] + spatial)
    shape = em.known_shape(x)
    for b in (scale_b, bias_b):
        em.set_meta(b, em.dtype(x), (1, shape[1]) + (1,) * len(spatial))
    dx, ds, db = _channel_stats_grad(ctx, x, g, scale_b, bias_b, spatial)
    return [dx, ds and em.squeeze(ds, [0] + spatial), db and em.squeeze(db, [0] + spatial)]


# doc_string of the BatchNormalization that build_training_model(mode="train") writes: its
# mean and var inputs are the batch mean and biased variance of its x (computed just before).
BATCH_STATISTICS_DOC = "onnx_training_ops: batch statistics (mode='train')"


def batch_norm_batch_statistics(ctx: RuleContext) -> list:
    """BatchNormalization on the *batch* statistics of ``x`` (over every axis but 1): with
    ``training_mode=1``, recomputed here from ``x``; the builder's node (``BATCH_STATISTICS_DOC``)
    gets them as inputs 3 and 4. The closed form includes the statistics' dependence on x, so
    inputs 3 and 4 get no gradient of their own (the running statistics, or values already
    accounted for)."""
    if any(ctx.grad(i) for i in (1, 2)):
        raise RuleError("gradients flowing into the running-statistic outputs are not supported")
    em, g = ctx.em, ctx.dy
    x, scale, bias = ctx.node.input[:3]
    if ctx.node.doc_string == BATCH_STATISTICS_DOC and BATCH_NORM_GRAD in em.native \
            and em.dtype(x) == em.dtype(scale) == TensorProto.FLOAT:
        return _native_batch_norm_grad(ctx) + [None] * (len(ctx.node.input) - 3)
    r = ctx.rank(x)
    shape = em.known_shape(x)
    axes = [0] + list(range(2, r))
    scale_b, bias_b = em.unsqueeze(scale, axes), em.unsqueeze(bias, axes)
    for b in (scale_b, bias_b):
        em.set_meta(b, em.dtype(x), (1, shape[1]) + (1,) * (r - 2))
    stats = None
    if ctx.node.doc_string == BATCH_STATISTICS_DOC:
        stats = (em.unsqueeze(ctx.node.input[3], axes), em.unsqueeze(ctx.node.input[4], axes))
    dx, ds, db = _channel_stats_grad(ctx, x, g, scale_b, bias_b, axes, stats)
    return [dx, ds and em.squeeze(ds, axes), db and em.squeeze(db, axes)] + [None] * (len(ctx.node.input) - 3)


def _native_batch_norm_grad(ctx: RuleContext) -> list:
    """(dx, dscale, dbias) of the builder's node as one native ``TrainingBatchNormGrad``
    (``kernels._native_norm_kernels``): the closed form above, two passes over x."""
    em = ctx.em
    x, scale, _, mean, var = ctx.node.input[:5]
    eps = em.scalar(float(ctx.attr("epsilon", 1e-5)), x)
    outs = [em.fresh(hint) for hint in ("dx", "dscale", "dbias")]
    em.add_node(helper.make_node(BATCH_NORM_GRAD, [ctx.dy, x, scale, mean, var, eps], outs, name=outs[0],
                                 domain=DOMAIN))
    x_shape = ctx.shape(x)
    channels = x_shape[1] if x_shape else None
    for out, shape in zip(outs, (x_shape, (channels,), (channels,))):
        em.set_meta(out, TensorProto.FLOAT, shape)
    return [out if ctx.need(i) else None for i, out in enumerate(outs)]


@register("GroupNormalization")
def _group_norm(ctx: RuleContext) -> list:
    """x [N, C, d...] seen as [N, G, C/G, S]: normalized over the last two axes. Scale and
    bias are per group ([G], opset 18) or per channel ([C], opset 21)."""
    em, g = ctx.em, ctx.dy
    x, scale, bias = ctx.node.input[:3]
    _check_float(ctx, x)
    shape = ctx.shape(x)
    groups = int(ctx.attr("num_groups"))
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        raise RuleError(f"GroupNormalization needs a static channel count for {x!r}")
    channels = shape[1]
    grouped = em.ints([0, groups, channels // groups, -1])
    x4 = em.op("Reshape", [x, grouped], "grouped")
    g4 = em.op("Reshape", [g, grouped], "grouped")
    per_channel = ctx.opset >= 21
    param_shape = em.ints([groups, channels // groups, 1] if per_channel else [groups, 1, 1])
    scale_b = em.op("Reshape", [scale, param_shape])
    bias_b = em.op("Reshape", [bias, param_shape])
    n = shape[0]
    dims = (n, groups, channels // groups, None)
    em.set_meta(x4, em.dtype(x), dims)
    em.set_meta(g4, em.dtype(x), dims)
    em.set_meta(scale_b, em.dtype(x), (groups, channels // groups, 1) if per_channel
                else (groups, 1, 1))
    em.set_meta(bias_b, em.dtype(x), em.shape(scale_b))
    dx, ds, db = _channel_stats_grad(ctx, x4, g4, scale_b, bias_b, [2, 3])
    return [dx and em.reshape_like(dx, x), ds and em.reshape_like(ds, scale),
            db and em.reshape_like(db, bias)]


@register("GlobalAveragePool")
def _global_average_pool(ctx: RuleContext) -> list:
    """g [N, C, 1...] spread evenly over the spatial positions."""
    em, x = ctx.em, ctx.node.input[0]
    shape = ctx.shape(x)
    if shape is not None and all(isinstance(d, int) for d in shape[2:]):
        count = em.scalar(float(np.prod(shape[2:], dtype=np.int64)), x)
    else:
        count = em.cast_like(em.op("ReduceProd", [em.dims_of(x, 2)], keepdims=0), x)
    g = em.op("Div", [ctx.dy, count])
    return [em.op("Expand", [g, em.shape_of(x)], "expand")]


@register("GlobalMaxPool")
def _global_max_pool(ctx: RuleContext) -> list:
    """g to the maxima of each channel, split evenly among ties (as torch's amax)."""
    em, x, y = ctx.em, ctx.node.input[0], ctx.y
    hit = em.cast_like(em.op("Equal", [x, y]), x)
    count = em.reduce_sum(hit, list(range(2, ctx.rank(x))), keepdims=True)
    return [em.op("Mul", [hit, em.op("Div", [ctx.dy, count])])]


# ----------------------------------------------------------------- onnxruntime's fused norms
# SimplifiedLayerNormalization (RMSNorm: no centering, no bias) and the Skip* forms of
# com.microsoft, ``s = input + skip (+ bias)`` normalized over the last axis; their output 3 is
# ``s`` itself (the next residual). The statistics are recomputed from ``s``: CUDA's kernels do
# not write the optional mean / inv_std_var outputs.
def rms_statistics(em: Emitter, x: str, axes: Sequence[int], eps: float) -> tuple[str, str]:
    """(xhat, inv) of ``x`` root-mean-square normalized over ``axes``."""
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [reduce_mean(em, em.op("Mul", [x, x]), axes),
                                                            em.scalar(eps, x)])])])
    return em.op("Mul", [x, inv]), inv


def rms_input_grad(em: Emitter, dxhat: str, xhat: str, inv: str, axes: Sequence[int]) -> str:
    """dx from dxhat through xhat = x * inv, inv = 1 / sqrt(mean(x^2) + eps) over ``axes``."""
    return em.op("Mul", [inv, em.op("Sub", [dxhat, em.op("Mul", [xhat, reduce_mean(
        em, em.op("Mul", [dxhat, xhat]), axes)])])])


def sum_to(em: Emitter, t: str, like: str) -> str:
    """``t`` summed over its leading axes down to the shape of ``like`` (its trailing axes)."""
    dims = static_dims(em.shape(like))
    rows = em.op("Reshape", [t, em.op("Concat", [em.ints([-1]), em.shape_of(like)], "rows", axis=0)
                             if dims is None else em.ints([-1, *dims])], "rows")
    return em.reduce_sum(rows, [0], keepdims=False)


def _normalized_axes(ctx: RuleContext, x: str) -> list[int]:
    axis = int(ctx.attr("axis", -1))
    if axis < 0:
        return list(range(axis, 0))
    return list(range(axis, ctx.rank(x)))


@register("SimplifiedLayerNormalization", "com.microsoft::SimplifiedLayerNormalization")
def _simplified_layer_norm(ctx: RuleContext) -> list:
    """RMSNorm, ``y = x / sqrt(mean(x^2) + eps) * scale`` over axes [axis, rank)."""
    if ctx.grad(1):
        raise RuleError("gradients flowing into the inv_std_var output are not supported")
    em, g = ctx.em, ctx.dy
    x, scale = ctx.node.input[:2]
    axes = _normalized_axes(ctx, x)
    xhat, inv = rms_statistics(em, x, axes, float(ctx.attr("epsilon", 1e-5)))
    out = ctx.empty()
    if ctx.need(0):
        out[0] = rms_input_grad(em, em.op("Mul", [g, scale]), xhat, inv, axes)
    if ctx.need(1):
        out[1] = sum_to(em, em.op("Mul", [g, xhat]), scale)
    return out


def _skip_norm(ctx: RuleContext, centered: bool) -> list:
    """``s = input + skip (+ bias)``; y = norm(s) * gamma (+ beta); output 3 = s."""
    em, g, g_sum = ctx.em, ctx.grad(0), ctx.grad(3)
    if ctx.grad(1) or ctx.grad(2):
        raise RuleError("gradients flowing into the mean / inv_std_var outputs are not supported")
    x, skip, gamma = ctx.node.input[:3]
    beta, bias = (ctx.input(3), ctx.input(4)) if centered else (None, ctx.input(3))
    ds = g_sum
    if g is not None:
        s = ctx.name_output(3, "skip_sum")
        em.set_meta(s, em.dtype(x), em.shape(x))
        eps = float(ctx.attr("epsilon", 1e-12))
        if centered:
            xhat, inv = statistics(em, s, [-1], eps)
        else:
            xhat, inv = rms_statistics(em, s, [-1], eps)
        dxhat = em.op("Mul", [g, gamma])
        d_norm = (normalized_input_grad if centered else rms_input_grad)(em, dxhat, xhat, inv, [-1])
        ds = d_norm if g_sum is None else em.op("Add", [d_norm, g_sum])
    out = ctx.empty()
    if ds is not None:
        out[0] = ds if ctx.need(0) else None
        out[1] = ctx.unbroadcast(ds, skip) if ctx.need(1) else None
        bias_at = 4 if centered else 3
        if bias is not None and ctx.need(bias_at):
            out[bias_at] = sum_to(em, ds, bias)
    if g is not None and ctx.need(2):
        out[2] = sum_to(em, em.op("Mul", [g, xhat]), gamma)
    if g is not None and beta is not None and ctx.need(3):
        out[3] = sum_to(em, g, beta)
    return out


@register("com.microsoft::SkipSimplifiedLayerNormalization")
def _skip_simplified_layer_norm(ctx: RuleContext) -> list:
    """RMSNorm of ``input + skip (+ bias)`` (inputs: input, skip, gamma, bias)."""
    return _skip_norm(ctx, centered=False)


@register("com.microsoft::SkipLayerNormalization")
def _skip_layer_norm(ctx: RuleContext) -> list:
    """LayerNorm of ``input + skip (+ bias)`` (inputs: input, skip, gamma, beta, bias)."""
    return _skip_norm(ctx, centered=True)
