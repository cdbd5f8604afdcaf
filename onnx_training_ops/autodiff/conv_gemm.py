"""Convolution gradients as single matrix products (im2col / col2im written in standard ops).

For ``y = Conv(x, w)`` with x [N, C, *S], w [O, C, *K], group 1 and static shapes, with the
output gradient as a matrix ``g2 = g`` [O, N*P] (channels first, P output positions):

* ``dW = g2 @ cols^T``: ``cols`` [K*C, N*P] stacks, for each kernel offset, the strided
  window of the padded input that offset reads (one Slice each, Concat on axis 0).
* ``dX = col2im(W2^T @ g2)``: each kernel offset's rows of the product are put back where
  that offset read them (Pad; zeros interleaved for strides), summed, and the padding cut.

On the native path (2-D) the im2col and col2im are one node each, the native
``TrainingIm2Col``/``TrainingCol2Im`` (:mod:`onnx_training_ops.kernels._native_grad_kernels`).

One Gemm each, with the whole batch in the inner dimension: onnxruntime's ConvTranspose
(for dX) runs one narrow product per image, and a Conv with the gradient as kernel (for dW)
an im2col as large as the kernel is wide; both were several times slower on ResNet-18's
layers. Kernel rows are ordered (offset, channel); ``w`` is permuted to match.
"""

from __future__ import annotations

import itertools

from .emitter import Emitter, static_dims
from .native_ops import COL2IM, COLS_OF, IM2COL


def gemm_geometry(em: Emitter, x: str, w: str, g: str, group: int, pb, pe) -> tuple | None:
    """``(x dims, w dims, g dims)`` when the Gemm forms apply (group 1, static shapes and
    pads), else None."""
    dims = [static_dims(em.shape(v)) for v in (x, w, g)]
    if group != 1 or any(d is None for d in dims) or not isinstance(pb, list) or not isinstance(pe, list):
        return None
    return tuple(dims)


def _channels_first(em: Emitter, v: str, rank: int) -> str:
    return em.op("Transpose", [v], "chfirst", perm=[1, 0] + list(range(2, rank)))


def gradient_rows(em: Emitter, g: str, geometry) -> str:
    """The output gradient (shaped like y) as [O, N*P]."""
    y_dims = geometry[2]
    return em.op("Reshape", [_channels_first(em, g, len(y_dims)), em.ints([y_dims[1], -1])], "g2")


def _native_geometry(em: Emitter, op: str, geometry, strides, dilations, pb) -> str | None:
    """The int64 geometry input of the native Im2Col/Col2Im (2-D convolutions, when the
    expansion allows native ops), else None."""
    (n_, c, *spatial), _, (_, _, *out) = geometry
    if op not in em.native or len(spatial) != 2:
        return None
    kernel = geometry[1][2:]
    return em.ints([n_, c, *spatial, *out, *kernel, *strides, *pb, *dilations])


def _offsets(kernel, dilations):
    return list(itertools.product(*[[k * d for k in range(size)] for size, d in zip(kernel, dilations)]))


def weight_grad(em: Emitter, x: str, g2: str, geometry, strides, dilations, pb, pe, conv: str = "") -> str:
    """``dW`` [O, C, *K] = ``g2 @ cols^T`` (module docstring); ``conv``: the forward node's
    name, written on a native Im2Col (``passes.conv_forward_gemm`` reuses its cols)."""
    (n_, c, *spatial), (o, _, *kernel), (_, _, *out) = geometry
    rank = len(spatial) + 2
    native = _native_geometry(em, IM2COL, geometry, strides, dilations, pb)
    if native is not None:
        cols = em.native_op(IM2COL, [x, native], "cols", doc=COLS_OF + conv if conv else "")
        return _weight_from_cols(em, g2, cols, o, kernel, c, rank)
    xt = _channels_first(em, x, rank)
    if any(pb) or any(pe):
        xt = em.op("Pad", [xt, em.ints([0, 0, *pb, 0, 0, *pe])], "pad")
    axes = em.ints(list(range(2, rank)))
    steps = em.ints(strides)
    windows = []
    for start in _offsets(kernel, dilations):
        ends = [b + s * (size - 1) + 1 for b, s, size in zip(start, strides, out)]
        padded = [size + b + e for size, b, e in zip(spatial, pb, pe)]
        if list(start) == [0] * len(start) and ends == padded and strides == [1] * len(strides):
            windows.append(xt)  # the whole (padded) input: a 1x1 kernel, stride 1
        else:
            windows.append(em.op("Slice", [xt, em.ints(start), em.ints(ends), axes, steps], "window"))
    stacked = windows[0] if len(windows) == 1 else em.op("Concat", windows, "cols", axis=0)
    cols = em.op("Reshape", [stacked, em.ints([-1, n_ * _prod(out)])], "cols")
    return _weight_from_cols(em, g2, cols, o, kernel, c, rank)


def _weight_from_cols(em: Emitter, g2: str, cols: str, o: int, kernel, c: int, rank: int) -> str:
    dw = em.op("Gemm", [g2, cols], "gemm", transB=1)  # [O, K*C]
    dw = em.op("Reshape", [dw, em.ints([o, *kernel, c])], "dw")
    return em.op("Transpose", [dw], "dw", perm=[0, rank - 1] + list(range(1, rank - 1)))


def input_grad(em: Emitter, w: str, g2: str, geometry, strides, dilations, pb, pe) -> str:
    """``dX`` [N, C, *S] = col2im(``W2^T @ g2``) (module docstring)."""
    (n_, c, *spatial), (o, _, *kernel), (_, _, *out) = geometry
    rank = len(spatial) + 2
    w2 = em.op("Transpose", [w], "w2", perm=[0] + list(range(2, rank)) + [1])  # [O, *K, C]
    w2 = em.op("Reshape", [w2, em.ints([o, -1])], "w2")
    rows = em.op("Gemm", [w2, g2], "gemm", transA=1)  # [K*C, N*P]
    native = _native_geometry(em, COL2IM, geometry, strides, dilations, pb)
    if native is not None:
        return em.native_op(COL2IM, [rows, native], "dx")
    offsets = _offsets(kernel, dilations)
    rows = em.op("Reshape", [rows, em.ints([len(offsets) * c, n_, *out])], "rows")
    parts = em.op_n("Split", [rows, em.ints([c] * len(offsets))], len(offsets), "part", axis=0) \
        if len(offsets) > 1 else [rows]
    padded = [size + b + e for size, b, e in zip(spatial, pb, pe)]
    placed = []
    for part, start in zip(parts, offsets):
        part, spread = _spread(em, part, out, strides, c, n_)
        before = [0, 0, *start]
        after = [0, 0, *[p - b - s for p, b, s in zip(padded, start, spread)]]
        placed.append(em.op("Pad", [part, em.ints(before + after)], "place") if any(before + after) else part)
    total = placed[0] if len(placed) == 1 else em.op("Sum", placed, "col2im")
    if any(pb) or any(pe):
        total = em.op("Slice", [total, em.ints(pb), em.ints([b + s for b, s in zip(pb, spatial)]),
                                em.ints(list(range(2, rank)))], "interior")
    return _channels_first(em, total, rank)


def _spread(em: Emitter, part: str, out, strides, c: int, n_: int) -> tuple[str, list]:
    """``part`` [C, N, *out] with ``stride - 1`` zeros after each element on each strided
    axis (the last ones cut); returns it and its spatial extent."""
    if all(s == 1 for s in strides):
        return part, list(out)
    dims = [c, n_]
    for size in out:
        dims += [size, 1]
    spaced = em.op("Reshape", [part, em.ints(dims)], "spread")
    pads = [0] * (2 * len(dims))
    for i, s in enumerate(strides):
        pads[len(dims) + 3 + 2 * i] = s - 1
    spaced = em.op("Pad", [spaced, em.ints(pads)], "spread")
    extent = [s * size for size, s in zip(out, strides)]
    spaced = em.op("Reshape", [spaced, em.ints([c, n_, *extent])], "spread")
    cut = [s * (size - 1) + 1 for size, s in zip(out, strides)]
    spaced = em.op("Slice", [spaced, em.ints([0] * len(out)), em.ints(cut),
                             em.ints(list(range(2, 2 + len(out))))], "spread")
    return spaced, cut


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
