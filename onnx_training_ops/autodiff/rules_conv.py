"""Convolutions: Conv and ConvTranspose, and the window helpers pooling shares.

Conv with group 1 and static shapes: one Gemm per gradient (:mod:`.conv_gemm`), what a CPU
runs fastest. Otherwise, and for a GPU (the expansion allows ``CONV_BY_CONV``: cuDNN's
convolutions beat an im2col of hundreds of Pad/Slice nodes there), convolution gradients are
written with the forward op's own adjoints:

* dX: ``ConvTranspose`` of the output gradient with W (no padding) gives the gradient with
  respect to the *padded* input, short of the trailing rows no window touched; it is padded
  with zeros to the padded length and the interior (``[pad_begin, pad_begin + X)``) sliced.
* dW: a ``Conv`` whose input is X (padded, with batch and channel axes swapped, grouped
  channels folded into the batch) and whose kernel is the output gradient; stride and
  dilation trade places, and the result is sliced to the kernel size.
* ConvTranspose is Conv's adjoint, so its dX is a Conv and its dW is Conv's dW with the roles
  of input and output gradient exchanged.

Pads come from ``pads`` or ``auto_pad``; for ``SAME_*`` with unknown spatial dims they are
computed at run time from ``Shape``.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import conv_gemm
from .emitter import Emitter, static_dims
from .native_ops import CONV_BY_CONV
from .registry import RuleContext, RuleError, register

Ints = list | str  # a static list of ints or the name of a 1-D int64 tensor


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
        return _static_same_pads(sp, strides, extent, upper)
    size = em.dims_of(x, 2)
    st = em.ints(strides)
    out = em.op("Div", [em.op("Add", [size, em.ints([v - 1 for v in strides])]), st])
    span = em.op("Add", [em.op("Mul", [em.op("Sub", [out, em.ints([1] * n)]), st]),
                         _const_or_tensor(em, extent)])
    total = em.op("Max", [em.op("Sub", [span, size]), em.ints([0] * n)])
    half = em.op("Div", [total, em.ints([2] * n)])
    pb = half if upper else em.op("Sub", [total, half])
    return pb, em.op("Sub", [total, pb])


def _static_same_pads(sizes: Sequence[int], strides: Sequence[int], extent: Sequence[int],
                      upper: bool) -> tuple[list[int], list[int]]:
    """SAME_UPPER / SAME_LOWER pads of static spatial ``sizes``: the output ceil(size / stride)."""
    pb, pe = [], []
    for size, st, ext in zip(sizes, strides, extent):
        out = -(-size // st)
        total = max(0, (out - 1) * st + ext - size)
        b = total // 2 if upper else total - total // 2
        pb.append(b)
        pe.append(total - b)
    return pb, pe


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


def _weight_grad(em: Emitter, x: str, g: str, w: str, kernel: Ints, strides, dilations,
                 group: int, pb: Ints, pe: Ints) -> str:
    """Gradient of ``Conv(x, w)`` with respect to ``w`` [O, I/group, k...], given the output
    gradient ``g``: a Conv of the padded input (batch and channel swapped, groups folded into
    the batch) with ``g`` as kernel, strides and dilations trading places."""
    n = len(strides)
    xp = x if _is_zero(pb) and _is_zero(pe) else em.op("Pad", [x, _pad_tensor(em, pb, pe)])
    if group == 1:
        xt = _swap01(em, xp, n + 2)
    else:
        ws = em.shape(w)
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
    return _swap01(em, dw, n + 2)


# ----------------------------------------------------------------------- Conv
def _geometry(ctx: RuleContext) -> tuple:
    """(x, w, kernel, spatial rank, strides, dilations, group) of a Conv/ConvTranspose."""
    x, w = ctx.node.input[:2]
    kernel = _kernel(ctx, w)
    n = len(kernel) if isinstance(kernel, list) else ctx.rank(x) - 2
    strides, dilations = _window(ctx, n)
    return x, w, kernel, n, strides, dilations, int(ctx.attr("group", 1))


@register("Conv")
def _conv(ctx: RuleContext) -> list:
    if ctx.opset < 11:
        raise RuleError(f"the Conv gradient needs opset >= 11 (graph has {ctx.opset})")
    em, g = ctx.em, ctx.dy
    x, w, kernel, n, strides, dilations, group = _geometry(ctx)
    pb, pe = _pads(ctx, x, kernel, strides, dilations)
    out = ctx.empty()
    geometry = None if CONV_BY_CONV in em.native else conv_gemm.gemm_geometry(em, x, w, ctx.y, group, pb, pe)
    if geometry is not None:  # one Gemm per gradient (conv_gemm)
        g2 = conv_gemm.gradient_rows(em, g, geometry)
        if ctx.need(0):
            out[0] = conv_gemm.input_grad(em, w, g2, geometry, strides, dilations, pb, pe)
        if ctx.need(1):
            out[1] = conv_gemm.weight_grad(em, x, g2, geometry, strides, dilations, pb, pe, ctx.node.name)
        if ctx.need(2):
            out[2] = em.reduce_sum(g2, [1], keepdims=False)
        return out
    if ctx.need(0):
        out[0] = _input_grad(em, g, w, x, _spatial(em, ctx.y), kernel, strides,
                             dilations, group, pb, pe)
    if ctx.need(1):
        out[1] = _weight_grad(em, x, g, w, kernel, strides, dilations, group, pb, pe)
    if ctx.need(2):
        out[2] = em.reduce_sum(g, [0] + list(range(2, 2 + n)), keepdims=False)
    return out


# ----------------------------------------------------------------------- ConvTranspose
def _transpose_pads(ctx: RuleContext, x: str, kernel: Ints, strides, dilations) -> tuple:
    """Begin/end pads of a ConvTranspose: explicit, VALID, or SAME with static shapes
    (output size = input size x stride; SAME_UPPER puts the smaller half first, SAME_LOWER
    the larger, as the spec says)."""
    n = len(strides)
    auto_pad = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    if ctx.attr("output_shape"):
        raise RuleError("ConvTranspose with output_shape has no derivative rule; export with "
                        "explicit pads/output_padding")
    if auto_pad == "NOTSET":
        pads = list(ctx.attr("pads") or [0] * (2 * n))
        return pads[:n], pads[n:]
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    s = ctx.shape(x)
    sp = static_dims(s[2:]) if s is not None else None
    if sp is None or not isinstance(kernel, list):
        raise RuleError("ConvTranspose with auto_pad=SAME_* needs static input and kernel shapes")
    out_pad = list(ctx.attr("output_padding") or [0] * n)
    pb, pe = [], []
    for size, st, d, k, op in zip(sp, strides, dilations, kernel, out_pad):
        total = st * (size - 1) + op + (k - 1) * d + 1 - size * st
        first = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        pb.append(first)
        pe.append(total - first)
    return pb, pe


@register("ConvTranspose")
def _conv_transpose(ctx: RuleContext) -> list:
    """ConvTranspose is the adjoint of Conv with the same W, strides, pads and dilations:
    dx = Conv(g, W); dW is Conv's weight gradient with input g and output gradient x."""
    em, g = ctx.em, ctx.dy
    x, w, kernel, n, strides, dilations, group = _geometry(ctx)
    pb, pe = _transpose_pads(ctx, x, kernel, strides, dilations)
    pads = list(pb) + list(pe)
    out = ctx.empty()
    if ctx.need(0):
        out[0] = em.op("Conv", [g, w], "convX", strides=strides, dilations=dilations,
                       group=group, pads=pads, kernel_shape=kernel if isinstance(kernel, list)
                       else None)
    if ctx.need(1):
        # Conv(g; W) gives x: W's weight gradient takes the padded g as input, x as gradient;
        # trailing rows of g that no output position reads (output_padding) are cut by the
        # kernel-size slice.
        out[1] = _weight_grad(em, g, x, w, kernel, strides, dilations, group, pb, pe)
    if ctx.need(2):
        out[2] = em.reduce_sum(g, [0] + list(range(2, 2 + n)), keepdims=False)
    return out
