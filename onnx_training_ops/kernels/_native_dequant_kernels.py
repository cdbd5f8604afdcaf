"""C-callable block dequantization (a numba cfunc) for onnxruntime's custom-op C API.

``TrainingDequantizeRows(packed, scales, zero_points, config, after)`` -> ``w [stop - start, K]``:
rows ``start:stop`` of a ``MatMulNBits`` weight, ``w[r, k] = (q[r, k] - zp[r, k // block]) *
scale[r, k // block]`` in float32, what onnxruntime's ``GatherBlockQuantized`` gives for those
rows (the same two roundings: an exact integer difference, one product). ``packed`` is uint8
``[N, blocks * block * bits / 8]`` (values low bits first), ``scales`` float32 ``[N, blocks]``,
``zero_points`` uint8 ``[N, ceil(blocks * bits / 8)]`` or empty (zero point ``2^(bits-1)``),
``config`` int64 (``CFG_*``): bits (2, 4 or 8), block, K, start, stop. ``after`` (any tensor) is
not read: onnxruntime runs the node once it exists (the backward pass's gradient, the previous row
range's product), so the float rows are made just before they are used, and never folded.

The derivative rule of ``MatMulNBits`` dequantizes a weight's row ranges with it on the native
path (:mod:`onnx_training_ops.autodiff.rules_quantized`), and so does the CPU forward
(:mod:`onnx_training_ops.passes.dequantize_matmul_nbits`): vectorized, it takes about a third of
``GatherBlockQuantized``'s time. Rows are split over onnxruntime's thread pool.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ._native_grad_kernels import ST_API, ST_CHUNK, ST_SHAPE_REFERENCE, ST_WORDS, ST_WORKER, _invalid, _output
from ._ort_api import (
    _OPTIONS,
    API_KERNEL_CONTEXT_PARALLEL_FOR,
    API_TABLE_LENGTH,
    COMPUTE,
    ELEM_FLOAT,
    ELEM_INT64,
    WORKER,
    _addr,
    _call5,
    _count,
    _input,
    _keep,
    _ptr,
    lazy_cfunc,
)

CFG_BITS, CFG_BLOCK, CFG_K, CFG_START, CFG_STOP = range(5)  # config words
CFG_WORDS = 5
ELEM_UINT8 = 2
# job words: the config, rows per task, row bytes, blocks, zero-point bytes per row, addresses
J_ROWS, J_ROW_BYTES, J_BLOCKS, J_ZP_BYTES, J_PACKED, J_SCALES, J_ZP, J_OUT = range(CFG_WORDS, CFG_WORDS + 8)
J_WORDS = CFG_WORDS + 8

_I64 = np.int64(0)
_F32 = np.float32(0)
_U8 = np.uint8(0)


@njit(**_OPTIONS)
def _dequantize(packed, scales, zero_points, out, bits, block, k):
    """``out[r] = (q[r] - zp[r, block]) * scale[r, block]`` for 2-D ``packed``, ``scales``,
    ``zero_points`` (no column: the default zero point) and ``out`` of the same rows. Per block,
    its codes as floats into a small buffer, then the scaled values: two simple loops the
    compiler vectorizes (one fused loop over the packed bytes it does not: 0.23 against 0.86 ns
    an element, measured)."""
    mask = (1 << bits) - 1
    codes = np.empty(block, np.float32)
    for r in range(out.shape[0]):
        for j in range((k + block - 1) // block):
            base = j * block
            width = min(block, k - base)
            if bits == 4 and width == block:
                first = base >> 1
                for i in range(block >> 1):
                    byte = packed[r, first + i]
                    codes[2 * i] = np.float32(byte & 15)
                    codes[2 * i + 1] = np.float32(byte >> 4)
            else:
                for i in range(width):
                    bit = (base + i) * bits
                    codes[i] = np.float32((packed[r, bit >> 3] >> (bit & 7)) & mask)
            if zero_points.shape[1]:
                bit = j * bits
                zp = np.float32((zero_points[r, bit >> 3] >> (bit & 7)) & mask)
            else:
                zp = np.float32(1 << (bits - 1))
            scale = scales[r, j]
            for i in range(width):
                out[r, base + i] = (codes[i] - zp) * scale


@njit(**_OPTIONS)
def _rows(job, index):
    """Dequantize the task ``index``'s rows."""
    first = job[CFG_START] + index * job[J_ROWS]
    count = min(job[CFG_STOP], first + job[J_ROWS]) - first
    if count <= 0:
        return
    k, blocks, row_bytes, zp_bytes = job[CFG_K], job[J_BLOCKS], job[J_ROW_BYTES], job[J_ZP_BYTES]
    _dequantize(carray(_ptr(job[J_PACKED] + first * row_bytes, _U8), (count, row_bytes)),
                carray(_ptr(job[J_SCALES] + 4 * first * blocks, _F32), (count, blocks)),
                carray(_ptr(job[J_ZP] + first * zp_bytes, _U8), (count, zp_bytes)),
                carray(_ptr(job[J_OUT] + 4 * (first - job[CFG_START]) * k, _F32), (count, k)),
                job[CFG_BITS], job[CFG_BLOCK], k)


@lazy_cfunc(WORKER)
def dequantize_rows_worker(job, index):
    """``KernelContext_ParallelFor`` task: one range of rows."""
    _rows(carray(_ptr(_addr(job), _I64), J_WORDS), np.int64(index))


@njit(**_OPTIONS)
def _begin(state_addr, job_words):
    """A kernel call's state words, OrtApi table and work array (its job words, then scratch)."""
    state = carray(_ptr(state_addr, _I64), ST_WORDS)
    return state, carray(_ptr(state[ST_API], _I64), API_TABLE_LENGTH), np.zeros(job_words + 8, np.int64)


@njit(**_OPTIONS)
def _run(fns, state, context, job, tasks):
    """The job's ``tasks`` on onnxruntime's thread pool, by the kernel's worker (a single task runs
    on this thread)."""
    return _call5(fns[API_KERNEL_CONTEXT_PARALLEL_FOR], context, state[ST_WORKER], tasks, np.int64(0),
                  job.ctypes.data)


@njit(**_OPTIONS)
def _dequantize_rows(state_addr, context):
    state, fns, work = _begin(state_addr, J_WORDS)
    reference = state[ST_SHAPE_REFERENCE]
    job, out = work[:J_WORDS], work[J_WORDS:]
    status, elem, dims, config = _input(fns, reference, context, np.int64(3), out)
    if status != 0:
        return status
    if elem != ELEM_INT64 or _count(dims) != CFG_WORDS:
        return _invalid(fns, state)
    cfg = carray(_ptr(config, _I64), CFG_WORDS)
    for i in range(CFG_WORDS):
        job[i] = cfg[i]
    bits, block, k, start, stop = cfg[CFG_BITS], cfg[CFG_BLOCK], cfg[CFG_K], cfg[CFG_START], cfg[CFG_STOP]
    if (bits != 2 and bits != 4 and bits != 8) or block <= 0 or (block * bits) % 8 or k <= 0:
        return _invalid(fns, state)
    blocks = (k + block - 1) // block
    job[J_BLOCKS], job[J_ROW_BYTES], job[J_ZP_BYTES] = blocks, blocks * block * bits // 8, 0
    status, elem, dims, job[J_PACKED] = _input(fns, reference, context, np.int64(0), out)
    if status != 0:
        return status
    if elem != ELEM_UINT8 or dims.size < 1 or dims[0] <= 0 or _count(dims) != dims[0] * job[J_ROW_BYTES]:
        return _invalid(fns, state)
    n = dims[0]
    if start < 0 or stop > n or start >= stop:
        return _invalid(fns, state)
    status, elem, dims, job[J_SCALES] = _input(fns, reference, context, np.int64(1), out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT or _count(dims) != n * blocks:
        return _invalid(fns, state)
    status, elem, dims, job[J_ZP] = _input(fns, reference, context, np.int64(2), out)
    if status != 0:
        return status
    zp_count = _count(dims)
    if elem != ELEM_UINT8 or (zp_count != 0 and zp_count != n * ((blocks * bits + 7) // 8)):
        return _invalid(fns, state)
    if zp_count:
        job[J_ZP_BYTES] = (blocks * bits + 7) // 8
    shape = np.empty(2, np.int64)
    shape[0], shape[1] = stop - start, k
    status, job[J_OUT] = _output(fns, context, 0, shape, out)
    if status != 0:
        return status
    rows = max(np.int64(1), state[ST_CHUNK] // k)  # rows per task
    tasks = (stop - start + rows - 1) // rows
    job[J_ROWS] = rows
    status = _run(fns, state, context, job, tasks)
    _keep(work)
    return status


@lazy_cfunc(COMPUTE)
def dequantize_rows_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingDequantizeRows."""
    return _dequantize_rows(_addr(op_kernel), _addr(context))


# ---- int8 rounding of activations ----

# TrainingInt8Blocks(x [..., K], config) -> x rounded to int8 and back per block of ``block``
# along K, as onnxruntime's int8-activation MatMulNBits kernels quantize their input: symmetric,
# scale max|x| / 127 per block, half to even, a last partial block as if padded with zeros.
# config: int64 [block]. Rows are split over the thread pool.
RB_BLOCK = 0  # config word
RB_ROWS, RB_K, RB_BLOCK_LEN, RB_TASK, RB_X, RB_Y = range(6)  # job words
RB_WORDS = 6
_TINY = np.float32(np.finfo(np.float32).tiny)


@njit(**_OPTIONS)
def _int8_rows(x, y, block):
    for r in range(x.shape[0]):
        for base in range(0, x.shape[1], block):
            stop = min(base + block, x.shape[1])
            amax = np.float32(0)
            for i in range(base, stop):
                amax = max(amax, abs(x[r, i]))
            scale = amax / np.float32(127)
            safe = max(scale, _TINY)  # an all-zero block: zeros back
            for i in range(base, stop):
                y[r, i] = np.float32(np.rint(x[r, i] / safe)) * scale


@njit(**_OPTIONS)
def _int8_task(job, index):
    first = index * job[RB_TASK]
    count = min(job[RB_ROWS], first + job[RB_TASK]) - first
    if count > 0:
        k = job[RB_K]
        _int8_rows(carray(_ptr(job[RB_X] + 4 * first * k, _F32), (count, k)),
                   carray(_ptr(job[RB_Y] + 4 * first * k, _F32), (count, k)), job[RB_BLOCK_LEN])


@lazy_cfunc(WORKER)
def int8_blocks_worker(job, index):
    """``KernelContext_ParallelFor`` task: one range of rows."""
    _int8_task(carray(_ptr(_addr(job), _I64), RB_WORDS), np.int64(index))


@njit(**_OPTIONS)
def _int8_blocks(state_addr, context):
    state, fns, work = _begin(state_addr, RB_WORDS)
    reference = state[ST_SHAPE_REFERENCE]
    job, out = work[:RB_WORDS], work[RB_WORDS:]
    status, elem, dims, config = _input(fns, reference, context, np.int64(1), out)
    if status != 0:
        return status
    if elem != ELEM_INT64 or _count(dims) != 1:
        return _invalid(fns, state)
    job[RB_BLOCK_LEN] = carray(_ptr(config, _I64), 1)[RB_BLOCK]
    status, elem, dims, job[RB_X] = _input(fns, reference, context, np.int64(0), out)
    if status != 0:
        return status
    if elem != ELEM_FLOAT or dims.size < 1 or job[RB_BLOCK_LEN] <= 0:
        return _invalid(fns, state)
    x_dims = dims.copy()
    k = x_dims[x_dims.size - 1]
    total = _count(x_dims)
    status, job[RB_Y] = _output(fns, context, 0, x_dims, out)
    if status != 0 or total == 0:
        return status
    job[RB_K], job[RB_ROWS] = k, total // k
    job[RB_TASK] = max(np.int64(1), state[ST_CHUNK] // k)
    status = _run(fns, state, context, job, (job[RB_ROWS] + job[RB_TASK] - 1) // job[RB_TASK])
    _keep(work)
    return status


@lazy_cfunc(COMPUTE)
def int8_blocks_compute(op_kernel, context):
    """``KernelComputeV2`` of TrainingInt8Blocks."""
    return _int8_blocks(_addr(op_kernel), _addr(context))
