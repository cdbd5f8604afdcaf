"""C-callable backward kernels (numba cfuncs) for onnxruntime's custom-op C API.

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

Registered by :mod:`onnx_training_ops.runtime.native_grads` (the same route as the native
optimizers: ``AddExternalCustomOp`` of onnxruntime-extensions); the OrtApi helpers are
:mod:`._native_kernels`'.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, types

from ._native_kernels import (API_KERNEL_CONTEXT_GET_OUTPUT, API_KERNEL_CONTEXT_PARALLEL_FOR,
                              API_GET_TENSOR_MUTABLE_DATA, API_CREATE_STATUS, API_TABLE_LENGTH, ELEM_FLOAT,
                              ELEM_INT64, ORT_INVALID_ARGUMENT, _addr, _call2, _call5, _call_void1, _input, _keep,
                              _ptr)

# geometry words
GEO_N, GEO_C, GEO_H, GEO_W, GEO_OH, GEO_OW, GEO_KH, GEO_KW = range(8)
GEO_SH, GEO_SW, GEO_PH, GEO_PW, GEO_DH, GEO_DW = range(8, 14)
GEO_WORDS = 14

# kernel state words (malloc-ed by runtime.native_grads): the OrtApi table, the error message
# (a C string naming the node), libc's free, the ParallelFor worker's address
ST_API, ST_MESSAGE, ST_FREE, ST_WORKER = 0, 1, 2, 3
ST_WORDS = 4

# job words: geometry, then the source and destination addresses
JOB_SRC, JOB_DST = GEO_WORDS, GEO_WORDS + 1
JOB_WORDS = GEO_WORDS + 2

_I64 = np.int64(0)
_F32 = np.float32(0)
_OPTIONS = dict(nogil=True, cache=True, fastmath=False, error_model="numpy", boundscheck=False)


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


@cfunc(types.void(types.voidptr, types.uintp), **_OPTIONS)
def im2col_worker(job, index):
    """``KernelContext_ParallelFor`` task: one channel of Im2Col."""
    _im2col_channel(carray(_ptr(_addr(job), _I64), JOB_WORDS), np.int64(index))


@cfunc(types.void(types.voidptr, types.uintp), **_OPTIONS)
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
    status, elem, dims, src = _input(fns, 0, context, 0, out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT:
        return _invalid(fns, state)
    x_dims = dims.copy()
    status, elem, dims, geo = _input(fns, 0, context, 1, out)
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


@cfunc(types.int64(types.voidptr, types.voidptr), **_OPTIONS)
def im2col_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingIm2Col."""
    return _compute(_addr(op_kernel), _addr(context), False)


@cfunc(types.int64(types.voidptr, types.voidptr), **_OPTIONS)
def col2im_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingCol2Im."""
    return _compute(_addr(op_kernel), _addr(context), True)


@cfunc(types.void(types.voidptr), **_OPTIONS)
def kernel_destroy(op_kernel):
    """``OrtCustomOp.KernelDestroy``: frees the state block with the ``free`` it names."""
    state = carray(_ptr(_addr(op_kernel), _I64), ST_WORDS)
    _call_void1(state[ST_FREE], _addr(op_kernel))
