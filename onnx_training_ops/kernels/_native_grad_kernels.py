"""C-callable backward and loss kernels (numba cfuncs) for onnxruntime's custom-op C API.

The data-movement halves of a convolution's gradients, which stock onnxruntime has no op
for, around the Gemm that onnxruntime runs (:mod:`onnx_training_ops.autodiff.conv_gemm`):

* ``TrainingIm2Col(x [N, C, H, W], geometry)`` -> ``cols [KH*KW*C, N*OH*OW]``: row
  ``k*C + c`` holds, for every image and output position, the padded input element kernel
  offset ``k`` reads on channel ``c`` (zero in the padding).
* ``TrainingCol2Im(rows [KH*KW*C, N*OH*OW], geometry)`` -> ``dx [N, C, H, W]``: the
  adjoint, each row element added where Im2Col took it from (padding dropped).

``geometry`` is an int64 vector (``GEO_*``): N, C, H, W, OH, OW, KH, KW, strides, begin pads,
dilations. Work is split over channels by onnxruntime's own thread pool
(``KernelContext_ParallelFor``); channels write disjoint memory.

One-pass kernels for the small nodes a classifier's step is made of (one node each where
the standard-op forms take 3 to 7, :mod:`onnx_training_ops.autodiff.rules_loss`):

* ``TrainingReluGrad(dy, y)`` -> ``dx = dy * (y > 0)``, chunks over the thread pool past
  ``ST_PARALLEL_MIN`` elements;
* ``TrainingCrossEntropyLoss(log_prob [N, C], labels [N], config)`` -> the scalar loss
  ``-sum(log_prob[i, label_i])`` over kept rows [/ their count];
* ``TrainingCrossEntropyGrad(g, prob, labels, config)`` -> ``(prob - onehot) * g`` [/ count],
  ignored rows zero (NaN everywhere for a mean over no kept row, as the standard ops give);
  ``prob = exp(log_prob)`` is onnxruntime's vectorized Exp, so the gradient is bit-identical to
  the standard form's.

``config`` is an int64 vector (``CE_*``): reduction (``CE_MEAN``/``CE_SUM``), whether there
is an ignore_index, its value. A label neither in ``[0, C)`` nor ignored is an error.

Registered by :mod:`onnx_training_ops.runtime.native_grads` (the same route as the native
optimizers: ``AddExternalCustomOp`` of onnxruntime-extensions); the OrtApi helpers are
:mod:`._native_kernels`'.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ._ort_api import (
    _OPTIONS,
    API_CREATE_STATUS,
    API_GET_TENSOR_MUTABLE_DATA,
    API_KERNEL_CONTEXT_GET_OUTPUT,
    API_KERNEL_CONTEXT_PARALLEL_FOR,
    API_TABLE_LENGTH,
    COMPUTE,
    ELEM_FLOAT,
    ELEM_INT64,
    ORT_INVALID_ARGUMENT,
    WORKER,
    _addr,
    _call2,
    _call5,
    _count,
    _input,
    _keep,
    _ptr,
    lazy_cfunc,
)

# geometry words
GEO_N, GEO_C, GEO_H, GEO_W, GEO_OH, GEO_OW, GEO_KH, GEO_KW = range(8)
GEO_SH, GEO_SW, GEO_PH, GEO_PW, GEO_DH, GEO_DW = range(8, 14)
GEO_WORDS = 14

# kernel state words (after the header of _ort_api; made by runtime.native_grads): the OrtApi
# table, the error message (a C string naming the node), the ParallelFor worker's address, the
# address of GetTensorElementTypeAndShapeDataReference (0 below API 24), elementwise ops'
# parallel threshold and chunk (elements)
ST_API, ST_MESSAGE, ST_WORKER, ST_SHAPE_REFERENCE, ST_PARALLEL_MIN, ST_CHUNK = range(6)
ST_WORDS = 6

# job words: geometry, then the source and destination addresses
JOB_SRC, JOB_DST = GEO_WORDS, GEO_WORDS + 1
JOB_WORDS = GEO_WORDS + 2

_I64 = np.int64(0)
_F32 = np.float32(0)


@njit(**_OPTIONS)
def _inside(size, stride, offset, limit):
    """``[first, last)``: the output positions ``b`` of ``range(size)`` whose input position
    ``b * stride + offset`` lies in ``[0, limit)``."""
    first = 0 if offset >= 0 else (-offset + stride - 1) // stride
    last = 0 if limit - offset <= 0 else min(size, (limit - offset + stride - 1) // stride)
    return first, max(first, last)


@njit(**_OPTIONS)
def _window(job, c, i, j):
    """Kernel offset (i, j) on channel ``c``: the output rows ``[a0, a1)`` and columns
    ``[b0, b1)`` that read inside the image, and where row ``k*C + c`` of cols starts."""
    ch, h, w, oh, ow, kw = job[GEO_C], job[GEO_H], job[GEO_W], job[GEO_OH], job[GEO_OW], job[GEO_KW]
    a0, a1 = _inside(oh, job[GEO_SH], i * job[GEO_DH] - job[GEO_PH], h)
    b0, b1 = _inside(ow, job[GEO_SW], j * job[GEO_DW] - job[GEO_PW], w)
    return a0, a1, b0, b1, ((i * kw + j) * ch + c) * job[GEO_N] * oh * ow


@njit(**_OPTIONS)
def _im2col_channel(job, c):
    """Rows ``k*C + c`` of cols for one channel ``c``."""
    n_, ch, h, w, oh, ow, kh, kw = job[0], job[1], job[2], job[3], job[4], job[5], job[6], job[7]
    sh, sw, ph, pw, dh, dw = job[8], job[9], job[10], job[11], job[12], job[13]
    x = carray(_ptr(job[JOB_SRC], _F32), n_ * ch * h * w)
    cols = carray(_ptr(job[JOB_DST], _F32), kh * kw * ch * n_ * oh * ow)
    for i in range(kh):
        for j in range(kw):
            a0, a1, b0, b1, base = _window(job, c, i, j)
            for n in range(n_):
                src = (n * ch + c) * h * w + j * dw - pw
                for a in range(oh):
                    dst = base + (n * oh + a) * ow
                    if a < a0 or a >= a1:
                        for b in range(ow):
                            cols[dst + b] = 0.0
                        continue
                    row = src + (a * sh - ph + i * dh) * w
                    for b in range(b0):
                        cols[dst + b] = 0.0
                    for b in range(b1, ow):
                        cols[dst + b] = 0.0
                    if sw == 1:
                        for b in range(b0, b1):
                            cols[dst + b] = x[row + b]
                    else:
                        for b in range(b0, b1):
                            cols[dst + b] = x[row + b * sw]


@njit(**_OPTIONS)
def _col2im_channel(job, c):
    """``dx[:, c]``: every element of rows ``k*C + c`` added back where Im2Col read it."""
    n_, ch, h, w, oh, ow, kh, kw = job[0], job[1], job[2], job[3], job[4], job[5], job[6], job[7]
    sw, ph, sh, dh = job[GEO_SW], job[GEO_PH], job[GEO_SH], job[GEO_DH]
    rows = carray(_ptr(job[JOB_SRC], _F32), kh * kw * ch * n_ * oh * ow)
    dx = carray(_ptr(job[JOB_DST], _F32), n_ * ch * h * w)
    for n in range(n_):
        start = (n * ch + c) * h * w
        for e in range(h * w):
            dx[start + e] = 0.0
    for i in range(kh):
        for j in range(kw):
            a0, a1, b0, b1, base = _window(job, c, i, j)
            for n in range(n_):
                dst = (n * ch + c) * h * w + j * job[GEO_DW] - job[GEO_PW]
                for a in range(a0, a1):
                    src = base + (n * oh + a) * ow
                    row = dst + (a * sh - ph + i * dh) * w
                    if sw == 1:
                        for b in range(b0, b1):
                            dx[row + b] += rows[src + b]
                    else:
                        for b in range(b0, b1):
                            dx[row + b * sw] += rows[src + b]


@lazy_cfunc(WORKER)
def im2col_worker(job, index):
    """``KernelContext_ParallelFor`` task: one channel of Im2Col."""
    _im2col_channel(carray(_ptr(_addr(job), _I64), JOB_WORDS), np.int64(index))


@lazy_cfunc(WORKER)
def col2im_worker(job, index):
    """``KernelContext_ParallelFor`` task: one channel of Col2Im."""
    _col2im_channel(carray(_ptr(_addr(job), _I64), JOB_WORDS), np.int64(index))


@njit(**_OPTIONS)
def _output(fns, context, index, dims, out):
    """``(status, data address)`` of output ``index``, allocated by onnxruntime with ``dims``."""
    status = _call5(fns[API_KERNEL_CONTEXT_GET_OUTPUT], context, np.int64(index), dims.ctypes.data,
                    np.int64(dims.size), out.ctypes.data)
    if status != 0:
        return status, 0
    status = _call2(fns[API_GET_TENSOR_MUTABLE_DATA], out[0], out.ctypes.data)
    return status, out[0]


@njit(**_OPTIONS)
def _invalid(fns, state):
    """The kernel's error status (its message names the node)."""
    return _call2(fns[API_CREATE_STATUS], np.int64(ORT_INVALID_ARGUMENT), state[ST_MESSAGE])


@njit(**_OPTIONS)
def _compute(state_addr, context, col2im):
    state = carray(_ptr(state_addr, _I64), ST_WORDS)
    fns = carray(_ptr(state[ST_API], _I64), API_TABLE_LENGTH)
    work = np.zeros(JOB_WORDS + 8, np.int64)
    job, out = work[:JOB_WORDS], work[JOB_WORDS:]
    status, elem, dims, src = _input(fns, state[ST_SHAPE_REFERENCE], context, np.int64(0), out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT:
        return _invalid(fns, state)
    x_dims = dims.copy()
    status, elem, dims, geo = _input(fns, state[ST_SHAPE_REFERENCE], context, np.int64(1), out)
    if status != 0:
        return status
    if elem != ELEM_INT64 or dims.size != 1 or dims[0] != GEO_WORDS:
        return _invalid(fns, state)
    g = carray(_ptr(geo, _I64), GEO_WORDS)
    for k in range(GEO_WORDS):
        job[k] = g[k]
    rows = g[GEO_KH] * g[GEO_KW] * g[GEO_C]
    row_len = g[GEO_N] * g[GEO_OH] * g[GEO_OW]
    image = g[GEO_N] * g[GEO_C] * g[GEO_H] * g[GEO_W]
    if col2im:
        ok = x_dims.size == 2 and x_dims[0] == rows and x_dims[1] == row_len
        out_dims = np.empty(4, np.int64)
        out_dims[0], out_dims[1], out_dims[2], out_dims[3] = g[GEO_N], g[GEO_C], g[GEO_H], g[GEO_W]
    else:
        ok = x_dims.size == 4 and x_dims[0] * x_dims[1] * x_dims[2] * x_dims[3] == image
        out_dims = np.empty(2, np.int64)
        out_dims[0], out_dims[1] = rows, row_len
    if not ok:
        return _invalid(fns, state)
    status, data = _output(fns, context, 0, out_dims, out)
    if status != 0:
        return status
    job[JOB_SRC], job[JOB_DST] = src, data
    status = _call5(fns[API_KERNEL_CONTEXT_PARALLEL_FOR], context, state[ST_WORKER], g[GEO_C], np.int64(0),
                    job.ctypes.data)
    _keep(out_dims)
    _keep(work)
    return status


@lazy_cfunc(COMPUTE)
def im2col_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingIm2Col."""
    return _compute(_addr(op_kernel), _addr(context), False)


@lazy_cfunc(COMPUTE)
def col2im_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingCol2Im."""
    return _compute(_addr(op_kernel), _addr(context), True)


# ---- ReLU gradient and cross entropy ----

RJ_N, RJ_CHUNK, RJ_DY, RJ_Y, RJ_DX = range(5)  # ReluGrad job words
RJ_WORDS = 5
CE_REDUCTION, CE_HAS_IGNORE, CE_IGNORE = range(3)  # config words
CE_WORDS = 3
CE_MEAN, CE_SUM = 0, 1


@njit(**_OPTIONS)
def _relu_grad_chunk(job, index):
    start = index * job[RJ_CHUNK]
    m = min(job[RJ_N], start + job[RJ_CHUNK]) - start
    if m <= 0:
        return
    dy = carray(_ptr(job[RJ_DY] + 4 * start, _F32), m)
    y = carray(_ptr(job[RJ_Y] + 4 * start, _F32), m)
    dx = carray(_ptr(job[RJ_DX] + 4 * start, _F32), m)
    for i in range(m):  # a product, as the standard form's Mul(dy, Cast(y > 0)): inf * 0 is NaN
        dx[i] = dy[i] * np.float32(y[i] > 0)


@lazy_cfunc(WORKER)
def relu_grad_worker(job, index):
    """``KernelContext_ParallelFor`` task: one chunk of ReluGrad."""
    _relu_grad_chunk(carray(_ptr(_addr(job), _I64), RJ_WORDS), np.int64(index))


@njit(**_OPTIONS)
def _relu_grad(state_addr, context):
    state = carray(_ptr(state_addr, _I64), ST_WORDS)
    fns = carray(_ptr(state[ST_API], _I64), API_TABLE_LENGTH)
    work = np.zeros(RJ_WORDS + 4, np.int64)
    job, out = work[:RJ_WORDS], work[RJ_WORDS:]
    status, elem, dims, dy = _input(fns, state[ST_SHAPE_REFERENCE], context, np.int64(0), out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT:
        return _invalid(fns, state)
    dy_dims = dims
    status, elem, dims, y = _input(fns, state[ST_SHAPE_REFERENCE], context, np.int64(1), out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT or dims.size != dy_dims.size:
        return _invalid(fns, state)
    n = 1
    for k in range(dims.size):
        if dims[k] != dy_dims[k]:
            return _invalid(fns, state)
        n *= dims[k]
    status, dx = _output(fns, context, 0, dy_dims, out)
    if status != 0:
        return status
    job[RJ_N], job[RJ_DY], job[RJ_Y], job[RJ_DX] = n, dy, y, dx
    chunk = state[ST_CHUNK]
    if n >= state[ST_PARALLEL_MIN] and n > chunk:
        job[RJ_CHUNK] = chunk
        status = _call5(fns[API_KERNEL_CONTEXT_PARALLEL_FOR], context, state[ST_WORKER],
                        np.int64((n + chunk - 1) // chunk), np.int64(0), job.ctypes.data)
    else:
        job[RJ_CHUNK] = n
        _relu_grad_chunk(job, 0)
    _keep(work)
    return status


@lazy_cfunc(COMPUTE)
def relu_grad_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingReluGrad."""
    return _relu_grad(_addr(op_kernel), _addr(context))


@njit(**_OPTIONS)
def _cross_entropy(state_addr, context, grad):
    """The loss (``grad`` False: inputs log_prob, labels, config) or its gradient (inputs g,
    prob, labels, config)."""
    state = carray(_ptr(state_addr, _I64), ST_WORDS)
    fns = carray(_ptr(state[ST_API], _I64), API_TABLE_LENGTH)
    shape_reference = state[ST_SHAPE_REFERENCE]
    out = np.zeros(8, np.int64)
    first = 1 if grad else 0  # the gradient's first input: g
    scale = np.float32(1)
    if grad:
        status, elem, dims, data = _input(fns, shape_reference, context, np.int64(0), out)
        if status != 0:
            return status
        if elem != ELEM_FLOAT or _count(dims) != 1:
            return _invalid(fns, state)
        scale = carray(_ptr(data, _F32), 1)[0]
    status, elem, dims, lp = _input(fns, shape_reference, context, first, out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT or dims.size != 2:
        return _invalid(fns, state)
    lp_dims = dims
    rows, classes = dims[0], dims[1]
    status, elem, dims, lab = _input(fns, shape_reference, context, first + 1, out)
    if status != 0:
        return status
    if elem != ELEM_INT64 or dims.size != 1 or dims[0] != rows:
        return _invalid(fns, state)
    status, elem, dims, cfg = _input(fns, shape_reference, context, first + 2, out)
    if status != 0:
        return status
    if elem != ELEM_INT64 or dims.size != 1 or dims[0] != CE_WORDS:
        return _invalid(fns, state)
    config = carray(_ptr(cfg, _I64), CE_WORDS)
    mean, has_ignore, ignore = config[CE_REDUCTION] == CE_MEAN, config[CE_HAS_IGNORE] != 0, config[CE_IGNORE]
    if config[CE_REDUCTION] != CE_MEAN and config[CE_REDUCTION] != CE_SUM:
        return _invalid(fns, state)
    labels = carray(_ptr(lab, _I64), rows)
    x = carray(_ptr(lp, _F32), rows * classes)  # log_prob (the loss) or prob (the gradient)
    count, total = _counted_rows(x, labels, classes, has_ignore, ignore, grad)
    if count < 0:
        return _invalid(fns, state)
    if not grad:
        return _write_loss(fns, context, lp_dims, out, total, count, mean)
    status, data = _output(fns, context, 0, lp_dims, out)
    if status != 0:
        return status
    d = carray(_ptr(data, _F32), rows * classes)
    if mean:  # the standard form's d * (g / count) is d / count in onnxruntime for a constant g = 1
        # (a loss's seed): d / (count / g) gives those bits
        _scaled_rows(d, x, labels, classes, has_ignore, ignore, np.float32(count) / scale, True)
    else:
        _scaled_rows(d, x, labels, classes, has_ignore, ignore, scale, False)
    return 0


@njit(**_OPTIONS)
def _counted_rows(x, labels, classes, has_ignore, ignore, grad):
    """The rows not ignored (-1 when a label is out of range) and, for the loss (``grad``
    False), the float64 sum of their labels' log_prob ``x``."""
    count = 0
    total = 0.0
    for i in range(labels.size):
        label = labels[i]
        if has_ignore and label == ignore:
            continue
        if label < 0 or label >= classes:
            return -1, total
        count += 1
        if not grad:
            total += np.float64(x[i * classes + label])
    return count, total


@njit(**_OPTIONS)
def _write_loss(fns, context, lp_dims, out, total, count, mean):
    """The loss output (a scalar): ``-total``, divided by ``count`` for the mean."""
    status, data = _output(fns, context, 0, lp_dims[:0], out)
    if status != 0:
        return status
    loss = np.float32(-total)
    carray(_ptr(data, _F32), 1)[0] = loss / np.float32(count) if mean else loss
    return 0


@njit(**_OPTIONS)
def _scaled_rows(d, prob, labels, classes, has_ignore, ignore, s, divide):
    """``d = (prob - onehot) * s`` (or ``/ s``), ``(prob * 0 - 0) * s`` on ignored rows: the
    standard form's float32 operations in its order, so the results are bit-identical."""
    zero = np.float32(0)
    for i in range(labels.size):
        label = labels[i]
        row = i * classes
        ignored = has_ignore and label == ignore
        for c in range(classes):
            v = prob[row + c] * zero - zero if ignored else prob[row + c] - np.float32(c == label)
            d[row + c] = v / s if divide else v * s


@lazy_cfunc(COMPUTE)
def cross_entropy_loss_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingCrossEntropyLoss."""
    return _cross_entropy(_addr(op_kernel), _addr(context), False)


@lazy_cfunc(COMPUTE)
def cross_entropy_grad_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingCrossEntropyGrad."""
    return _cross_entropy(_addr(op_kernel), _addr(context), True)
