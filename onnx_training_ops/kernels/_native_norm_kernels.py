"""C-callable kernels (numba cfuncs) of a train-mode BatchNormalization: its backward and
its batch statistics.

``TrainingBatchNormGrad(dy, x, scale, mean, var, eps) -> (dx, dscale, dbias)``, float32,
x and dy [N, C, spatial...], scale/mean/var [C] (the batch mean and biased variance of x),
eps a float32 scalar. Per channel, with ``M = N * spatial``, ``inv = 1 / sqrt(var + eps)``,
``xhat = (x - mean) * inv``:

    dbias = sum(dy),  dscale = sum(dy * xhat),
    dx = scale * inv / M * (M * dy - dbias - xhat * dscale)

One pass over dy and x for the sums (float64 accumulators), one writing dx (float32).

``TrainingBatchStats(x) -> (mean, var)`` [C]: the batch mean and biased variance over every
axis but 1, two passes (float64 accumulators), as the builder's standard nodes compute them
(``builder/train_mode.py``; rewritten by ``passes.batch_statistics_native``). Work
is split over channels by onnxruntime's thread pool (``KernelContext_ParallelFor``), as the
native im2col/col2im; the kernel state and its creation are theirs
(:mod:`._native_grad_kernels`, :mod:`onnx_training_ops.runtime.native_grads`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, njit

from ..optim._numba import JitOptions
from ._native_grad_kernels import ST_API, ST_SHAPE_REFERENCE, ST_WORDS, ST_WORKER, _invalid, _output
from ._ort_api import (
    _OPTIONS,
    API_KERNEL_CONTEXT_PARALLEL_FOR,
    API_TABLE_LENGTH,
    COMPUTE,
    ELEM_FLOAT,
    WORKER,
    _addr,
    _call5,
    _count,
    _input,
    _keep,
    _ptr,
    lazy_cfunc,
)

# job words: N, C, spatial size, then the addresses of the inputs and outputs
JOB_N, JOB_C, JOB_S = 0, 1, 2
JOB_DY, JOB_X, JOB_SCALE, JOB_MEAN, JOB_VAR, JOB_EPS = 3, 4, 5, 6, 7, 8  # input i at JOB_DY + i
JOB_DX, JOB_DSCALE, JOB_DBIAS = 9, 10, 11  # output i at JOB_DX + i
JOB_WORDS = 12
JOB_MEAN_OUT, JOB_VAR_OUT = 9, 10  # TrainingBatchStats: x at JOB_X, its outputs here
INPUTS = 6

_I64 = np.int64(0)
_F32 = np.float32(0)
_SUM_OPTIONS: JitOptions = {**_OPTIONS, "fastmath": {"reassoc"}}


@njit(**_SUM_OPTIONS)
def _sums(dy, x, mean):
    """(sum dy, sum dy * (x - mean)) in float64; reassociated (vectorized): the order of
    float64 additions of float32 terms moves the result by ~1e-16 relative."""
    a = 0.0
    b = 0.0
    for e in range(dy.size):
        g = np.float64(dy[e])
        a += g
        b += g * (np.float64(x[e]) - mean)
    return a, b


@njit(**_SUM_OPTIONS)
def _total(x):
    """sum x in float64, reassociated as :func:`_sums`."""
    a = 0.0
    for e in range(x.size):
        a += np.float64(x[e])
    return a


@njit(**_SUM_OPTIONS)
def _squares(x, mean):
    """sum (x - mean)^2 in float64, reassociated as :func:`_sums`."""
    b = 0.0
    for e in range(x.size):
        d = np.float64(x[e]) - mean
        b += d * d
    return b


@njit(**_OPTIONS)
def _dx(dy, x, dx, a, b, mean, d):
    """dx = a * dy - (b + (x - mean) * d), float32."""
    for e in range(dy.size):
        dx[e] = a * dy[e] - (b + (x[e] - mean) * d)


@njit(**_OPTIONS)
def _channel(job, c):
    """dx[:, c], dscale[c], dbias[c]."""
    n_, ch, s = job[JOB_N], job[JOB_C], job[JOB_S]
    size = n_ * ch * s
    dy = carray(_ptr(job[JOB_DY], _F32), size)
    x = carray(_ptr(job[JOB_X], _F32), size)
    dx = carray(_ptr(job[JOB_DX], _F32), size)
    scale = carray(_ptr(job[JOB_SCALE], _F32), ch)[c]
    mean32 = carray(_ptr(job[JOB_MEAN], _F32), ch)[c]
    var = carray(_ptr(job[JOB_VAR], _F32), ch)[c]
    eps = carray(_ptr(job[JOB_EPS], _F32), 1)[0]
    mean = np.float64(mean32)
    inv = 1.0 / math.sqrt(np.float64(var) + np.float64(eps))
    sum_dy = 0.0
    sum_dyxc = 0.0  # sum dy * (x - mean)
    for n in range(n_):  # slices, indexed from 0: loops LLVM vectorizes
        start = (n * ch + c) * s
        a, b = _sums(dy[start:start + s], x[start:start + s], mean)
        sum_dy += a
        sum_dyxc += b
    carray(_ptr(job[JOB_DBIAS], _F32), ch)[c] = np.float32(sum_dy)
    carray(_ptr(job[JOB_DSCALE], _F32), ch)[c] = np.float32(sum_dyxc * inv)
    m = n_ * s
    if m == 0:
        return
    k = np.float64(scale) * inv
    a32 = np.float32(k)  # dx = a * dy - (b + (x - mean) * d)
    b32 = np.float32(k * sum_dy / m)
    d32 = np.float32(k * inv * inv * sum_dyxc / m)
    for n in range(n_):
        start = (n * ch + c) * s
        _dx(dy[start:start + s], x[start:start + s], dx[start:start + s], a32, b32, mean32, d32)


@njit(**_OPTIONS)
def _stats_channel(job, c):
    """mean[c], var[c] (biased) of x[:, c]: the sum, then the squares about the mean."""
    n_, ch, s = job[JOB_N], job[JOB_C], job[JOB_S]
    x = carray(_ptr(job[JOB_X], _F32), n_ * ch * s)
    m = np.float64(n_ * s)
    total = 0.0
    for n in range(n_):
        start = (n * ch + c) * s
        total += _total(x[start:start + s])
    mean = total / m
    squares = 0.0
    for n in range(n_):
        start = (n * ch + c) * s
        squares += _squares(x[start:start + s], mean)
    carray(_ptr(job[JOB_MEAN_OUT], _F32), ch)[c] = np.float32(mean)
    carray(_ptr(job[JOB_VAR_OUT], _F32), ch)[c] = np.float32(squares / m)


@lazy_cfunc(WORKER)
def stats_worker(job, index):
    """``KernelContext_ParallelFor`` task: one channel's statistics."""
    _stats_channel(carray(_ptr(_addr(job), _I64), JOB_WORDS), np.int64(index))


@lazy_cfunc(WORKER)
def bn_grad_worker(job, index):
    """``KernelContext_ParallelFor`` task: one channel."""
    _channel(carray(_ptr(_addr(job), _I64), JOB_WORDS), np.int64(index))


@njit(**_OPTIONS)
def _compute(state_addr, context, stats):
    """``stats``: TrainingBatchStats (input x, outputs mean and var), else the gradient."""
    state = carray(_ptr(state_addr, _I64), ST_WORDS)
    fns = carray(_ptr(state[ST_API], _I64), API_TABLE_LENGTH)
    work = np.zeros(JOB_WORDS + 8, np.int64)
    job, out = work[:JOB_WORDS], work[JOB_WORDS:]
    shape_reference = state[ST_SHAPE_REFERENCE]
    status, elem, dims, addr = _input(fns, shape_reference, context, 0 if stats else 1, out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT or dims.size < 2:
        return _invalid(fns, state)
    x_dims = dims.copy()
    s = 1
    for k in range(2, x_dims.size):
        s *= x_dims[k]
    ch = x_dims[1]
    job[JOB_N], job[JOB_C], job[JOB_S] = x_dims[0], ch, s
    job[JOB_X] = addr
    for i in range(0 if stats else INPUTS):
        status, elem, dims, addr = _input(fns, shape_reference, context, i, out)
        if status != 0:
            return status
        if elem != ELEM_FLOAT:
            return _invalid(fns, state)
        count = _count(dims)
        if i == 0:
            ok = dims.size == x_dims.size
            for k in range(min(dims.size, x_dims.size)):
                ok = ok and dims[k] == x_dims[k]
        elif i == 1:
            ok = True
        else:
            ok = count == (1 if i == INPUTS - 1 else ch)
        if not ok:
            return _invalid(fns, state)
        job[JOB_DY + i] = addr
    channels = np.empty(1, np.int64)
    channels[0] = ch
    for i in range(2 if stats else 3):
        status, data = _output(fns, context, i, x_dims if i == 0 and not stats else channels, out)
        if status != 0:
            return status
        job[JOB_DX + i] = data
    status = _call5(fns[API_KERNEL_CONTEXT_PARALLEL_FOR], context, state[ST_WORKER], ch, np.int64(0),
                    job.ctypes.data)
    _keep(channels)
    _keep(x_dims)
    _keep(work)
    return status


@lazy_cfunc(COMPUTE)
def bn_grad_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingBatchNormGrad."""
    return _compute(_addr(op_kernel), _addr(context), False)


@lazy_cfunc(COMPUTE)
def stats_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingBatchStats."""
    return _compute(_addr(op_kernel), _addr(context), True)
