"""C-callable optimizer kernels for onnxruntime's custom-op C API, compiled by numba.

:mod:`onnx_training_ops.runtime.native` registers these as ``OrtCustomOp`` callbacks. Everything
here is ``nopython`` and ``nogil``: onnxruntime calls ``kernel_compute`` on its own threads.
Functions of the ``OrtApi`` table are called through their addresses (:mod:`._ort_api`).

The arithmetic is the fused kernels' (each optimizer's element and scalar preparation, in
:mod:`onnx_training_ops.optim`), written out of place: inputs
are onnxruntime's buffers (the caller's, no copy), outputs are the buffers onnxruntime hands
out (allocated, or the caller's IOBinding buffers, which may be the inputs themselves: every
element is read before it is written, so an output bound onto its input updates in place).
Large tensors are split in chunks run by onnxruntime's own intra-op thread pool
(``KernelContext_ParallelFor``), never numba's: no second thread pool, and any number of
concurrent sessions or runs is safe.

Memory layouts (int64 words) shared with :mod:`onnx_training_ops.runtime.native`:

* kernel state (one per node, ``malloc``-ed, freed by ``kernel_destroy``): see ``ST_*``;
  attributes are float64 bit patterns, error messages are C strings inside the block;
* job (one per optimized tensor, built here): see ``JOB_*``.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ..optim import adagrad as _adagrad
from ..optim import adam as _adam
from ..optim import momentum as _momentum
from . import _numba_kernels as _k
from ._ort_api import (
    _I64,
    _OPTIONS,
    API_CREATE_STATUS,
    API_GET_TENSOR_MUTABLE_DATA,
    API_KERNEL_CONTEXT_GET_INPUT_COUNT,
    API_KERNEL_CONTEXT_GET_OUTPUT,
    API_KERNEL_CONTEXT_GET_OUTPUT_COUNT,
    API_KERNEL_CONTEXT_PARALLEL_FOR,
    API_TABLE_LENGTH,
    COMPUTE,
    ELEM_DOUBLE,
    ELEM_FLOAT,
    ELEM_INT64,
    ORT_INVALID_ARGUMENT,
    WORKER,
    _addr,
    _broadcasts_to,
    _call2,
    _call5,
    _call_void2,
    _count,
    _expand,
    _input,
    _keep,
    _ptr,
    lazy_cfunc,
)

KIND_ADAM, KIND_MOMENTUM, KIND_NESTEROV, KIND_ADAGRAD = 0, 1, 2, 3
GROUPS_IN = (4, 3, 3, 3)  # X, G and the states per optimized tensor
GROUPS_OUT = (3, 2, 2, 2)

# kernel state words (after the header of _ort_api): the OrtApi table, the kind, the addresses of
# the kind's chunk workers for float32 and float64 tensors (:data:`WORKERS`), the parallel
# threshold and chunk (elements)
ST_API, ST_KIND, ST_CHUNK_F32, ST_CHUNK_F64, ST_PARALLEL_MIN, ST_CHUNK = 0, 1, 2, 3, 4, 5
ST_SHAPE_REFERENCE = 6  # address of GetTensorElementTypeAndShapeDataReference, or 0 (API < 24)
ST_ATTRS = 7  # 8 float64: adam alpha, beta, epsilon, norm, norm_post; momentum alpha, beta, norm;
#               adagrad decay_factor, epsilon, norm
ST_MESSAGES = 15  # ERR_COUNT char* error messages (naming the node)
ST_WORDS = 20
# numpy integers, not Python ints: numba types a Python int constant as a literal, and compiles
# a function called with one once per value
ERR_ARITY, ERR_RATE, ERR_COUNT_T, ERR_DTYPE, ERR_SHAPE = (np.int64(k) for k in range(5))
ERR_COUNT = 5
_ZERO, _ONE = np.int64(0), np.int64(1)

# job words
JOB_N, JOB_CHUNK, JOB_KIND = 0, 1, 2
JOB_IN = 3  # x, g, s1, s2 (s1/s2: v/h for Adam, v for Momentum, h for Adagrad)
JOB_OUT = 7  # x_new, s1_new, s2_new
JOB_R, JOB_T, JOB_ATTRS = 10, 11, 12  # the step's R (float64) and T, the node's 5 attributes (float64)
JOB_WORDS = JOB_ATTRS + 5
# the scalars a loop reads: the optimizer's named tuple (AdamScalars, ...), the fused kernels' layout
SCALAR_WORDS = max(len(t._fields) for t in (_adam.AdamScalars, _momentum.MomentumScalars, _adagrad.AdagradScalars))



# ---- element loops out of place: each optimizer's element (onnx_training_ops.optim) ----


@njit(**_OPTIONS)
def _adam_out(x, g, v, h, xo, vo, ho, s):
    c = _adam.load_scalars(s)
    for i in range(x.size):
        xo[i], vo[i], ho[i] = _adam.adam_element(x[i], g[i], v[i], h[i], c)


@njit(**_OPTIONS)
def _momentum_out(x, g, v, xo, vo, s):
    c = _momentum.load_scalars(s)
    for i in range(x.size):
        xo[i], vo[i] = _momentum.momentum_element(x[i], g[i], v[i], c)


@njit(**_OPTIONS)
def _nesterov_out(x, g, v, xo, vo, s):
    c = _momentum.load_scalars(s)
    for i in range(x.size):
        xo[i], vo[i] = _momentum.nesterov_element(x[i], g[i], v[i], c)


@njit(**_OPTIONS)
def _adagrad_out(x, g, h, xo, ho, s):
    c = _adagrad.load_scalars(s)
    for i in range(x.size):
        xo[i], ho[i] = _adagrad.adagrad_element(x[i], g[i], h[i], c)


@njit(inline="always", **_OPTIONS)
def _scalars(scalars, like):
    """An optimizer's scalars (its named tuple, float64) rounded to the arrays' dtype, as numpy
    rounds a Python float meeting an array of that dtype."""
    s = np.full(SCALAR_WORDS, like)
    for k in range(len(scalars)):
        s[k] = scalars[k]
    return s


@njit(inline="always", **_OPTIONS)
def _step(job_addr):
    """The job's R (float64), T and attributes."""
    job = carray(_ptr(job_addr, _I64), JOB_WORDS)
    jf = carray(_ptr(job_addr, np.float64(0)), JOB_WORDS)
    return jf[JOB_R], job[JOB_T], jf[JOB_ATTRS:JOB_ATTRS + 5]


@njit(inline="always", **_OPTIONS)
def _chunk(job_addr, index, like, size):
    """Chunk ``index`` of the job at ``job_addr`` on arrays of ``like``'s dtype (``size`` bytes):
    ``(m, x, g, s1, xo, s1o, in_place)``, m 0 past the end. ``in_place``: each output is bound
    onto its input (IOBinding, one OrtValue each), the state after s1 included."""
    job = carray(_ptr(job_addr, _I64), JOB_WORDS)
    start = index * job[JOB_CHUNK]
    m = max(min(job[JOB_N], start + job[JOB_CHUNK]) - start, 0)
    offset = start * size
    x = carray(_ptr(job[JOB_IN] + offset, like), m)
    g = carray(_ptr(job[JOB_IN + 1] + offset, like), m)
    s1 = carray(_ptr(job[JOB_IN + 2] + offset, like), m)
    xo = carray(_ptr(job[JOB_OUT] + offset, like), m)
    s1o = carray(_ptr(job[JOB_OUT + 1] + offset, like), m)
    in_place = job[JOB_OUT] == job[JOB_IN] and job[JOB_OUT + 1] == job[JOB_IN + 2] and (
        job[JOB_KIND] != KIND_ADAM or job[JOB_OUT + 2] == job[JOB_IN + 3])
    return m, x, g, s1, xo, s1o, in_place


# One loop per kind and dtype, each a cfunc of its own compiled when a node of that kind is first
# created, with the step's scalars prepared by the optimizer's own ``step_scalars`` (as the
# reference; a few flops per chunk). Outputs bound onto their inputs take the in-place loops: the
# out-of-place ones stay correct on aliased memory, but LLVM's overlap check then sends them down
# a scalar path, ~10x slower.


@njit(**_OPTIONS)
def _adam_chunk(job_addr, index, like, size):
    m, x, g, v, xo, vo, in_place = _chunk(job_addr, index, like, size)
    if m == 0:
        return
    r, t, a = _step(job_addr)
    s = _scalars(_adam.step_scalars(r, t, a[0], a[1], a[2], a[3], a[4]), like)
    job = carray(_ptr(job_addr, _I64), JOB_WORDS)
    h = carray(_ptr(job[JOB_IN + 3] + index * job[JOB_CHUNK] * size, like), m)
    if in_place:
        _k.adam_serial(x, g, v, h, s)
    else:
        _adam_out(x, g, v, h, xo, vo, carray(_ptr(job[JOB_OUT + 2] + index * job[JOB_CHUNK] * size, like), m), s)


@njit(**_OPTIONS)
def _momentum_chunk(job_addr, index, like, size):
    m, x, g, v, xo, vo, in_place = _chunk(job_addr, index, like, size)
    if m == 0:
        return
    r, t, a = _step(job_addr)
    s = _scalars(_momentum.step_scalars(r, t, a[0], a[1], a[2]), like)
    if in_place:
        _k.momentum_serial(x, g, v, s)
    else:
        _momentum_out(x, g, v, xo, vo, s)


@njit(**_OPTIONS)
def _nesterov_chunk(job_addr, index, like, size):
    m, x, g, v, xo, vo, in_place = _chunk(job_addr, index, like, size)
    if m == 0:
        return
    r, t, a = _step(job_addr)
    s = _scalars(_momentum.step_scalars(r, t, a[0], a[1], a[2]), like)
    if in_place:
        _k.nesterov_serial(x, g, v, s)
    else:
        _nesterov_out(x, g, v, xo, vo, s)


@njit(**_OPTIONS)
def _adagrad_chunk(job_addr, index, like, size):
    m, x, g, h, xo, ho, in_place = _chunk(job_addr, index, like, size)
    if m == 0:
        return
    r, t, a = _step(job_addr)
    s = _scalars(_adagrad.step_scalars(r, t, a[0], a[1], a[2]), like)
    if in_place:
        _k.adagrad_serial(x, g, h, s)
    else:
        _adagrad_out(x, g, h, xo, ho, s)


# ``KernelContext_ParallelFor`` workers (and the single-chunk call of a small tensor)
@lazy_cfunc(WORKER)
def adam_f32(job, index):
    _adam_chunk(_addr(job), np.int64(index), np.float32(0), np.int64(4))


@lazy_cfunc(WORKER)
def adam_f64(job, index):
    _adam_chunk(_addr(job), np.int64(index), np.float64(0), np.int64(8))


@lazy_cfunc(WORKER)
def momentum_f32(job, index):
    _momentum_chunk(_addr(job), np.int64(index), np.float32(0), np.int64(4))


@lazy_cfunc(WORKER)
def momentum_f64(job, index):
    _momentum_chunk(_addr(job), np.int64(index), np.float64(0), np.int64(8))


@lazy_cfunc(WORKER)
def nesterov_f32(job, index):
    _nesterov_chunk(_addr(job), np.int64(index), np.float32(0), np.int64(4))


@lazy_cfunc(WORKER)
def nesterov_f64(job, index):
    _nesterov_chunk(_addr(job), np.int64(index), np.float64(0), np.int64(8))


@lazy_cfunc(WORKER)
def adagrad_f32(job, index):
    _adagrad_chunk(_addr(job), np.int64(index), np.float32(0), np.int64(4))


@lazy_cfunc(WORKER)
def adagrad_f64(job, index):
    _adagrad_chunk(_addr(job), np.int64(index), np.float64(0), np.int64(8))


WORKERS = {KIND_ADAM: (adam_f32, adam_f64), KIND_MOMENTUM: (momentum_f32, momentum_f64),
           KIND_NESTEROV: (nesterov_f32, nesterov_f64), KIND_ADAGRAD: (adagrad_f32, adagrad_f64)}


# ---- compute ----


@njit(inline="always", **_OPTIONS)
def _error(fns, state, code):
    return _call2(fns[API_CREATE_STATUS], np.int64(ORT_INVALID_ARGUMENT), state[ST_MESSAGES + code])


@njit(inline="always", **_OPTIONS)
def _counts(fns, context, out):
    """``(status, inputs, outputs)``: the node's input and output counts."""
    status = _call2(fns[API_KERNEL_CONTEXT_GET_INPUT_COUNT], context, out.ctypes.data)
    if status != 0:
        return status, 0, 0
    n_in = out[0]
    status = _call2(fns[API_KERNEL_CONTEXT_GET_OUTPUT_COUNT], context, out.ctypes.data)
    return status, n_in, out[0]


@njit(inline="always", **_OPTIONS)
def _rate_and_count(fns, state, shape_reference, context, out):
    """``(status, R, T)``: the learning rate (float32 or float64 scalar, as float64) and the
    update count (int64 scalar), or an error status naming the node."""
    status, elem, dims, data = _input(fns, shape_reference, context, _ZERO, out)
    if status != 0:
        return status, 0.0, 0
    if dims.size > 1 or _count(dims) != 1:
        return _error(fns, state, ERR_RATE), 0.0, 0
    if elem == ELEM_FLOAT:
        r = np.float64(carray(_ptr(data, np.float32(0)), 1)[0])
    elif elem == ELEM_DOUBLE:
        r = carray(_ptr(data, np.float64(0)), 1)[0]
    else:
        return _error(fns, state, ERR_RATE), 0.0, 0
    status, elem, dims, data = _input(fns, shape_reference, context, _ONE, out)
    if status != 0:
        return status, 0.0, 0
    if elem != ELEM_INT64 or dims.size > 1 or _count(dims) != 1:
        return _error(fns, state, ERR_COUNT_T), 0.0, 0
    return 0, r, carray(_ptr(data, _I64), 1)[0]


@njit(inline="always", **_OPTIONS)
def _bind_inputs(fns, state, shape_reference, context, i, n, k_in, job, out):
    """X, G and the states of tensor ``i`` into the job; inputs that broadcast to X's shape
    are expanded into a scratch buffer. Returns ``(status, X's dims, element size in bytes,
    element count, scratch, expanded)``: the scratch must live until the update has run."""
    scratch = carray(_ptr(out.ctypes.data, np.uint8(0)), 0)
    expanded = False
    status, x_elem, x_dims, x_data = _input(fns, shape_reference, context, 2 + i, out)
    if status != 0:
        return status, x_dims, 0, 0, scratch, expanded
    if x_elem != ELEM_FLOAT and x_elem != ELEM_DOUBLE:
        return _error(fns, state, ERR_DTYPE), x_dims, 0, 0, scratch, expanded
    size = 4 if x_elem == ELEM_FLOAT else 8
    count = _count(x_dims)
    job[JOB_IN] = x_data
    for j in range(1, k_in):
        status, elem, dims, data = _input(fns, shape_reference, context, 2 + j * n + i, out)
        if status == 0 and elem != x_elem:
            status = _error(fns, state, ERR_DTYPE)
        if status == 0 and not _broadcasts_to(dims, x_dims):
            status = _error(fns, state, ERR_SHAPE)
        if status != 0:
            return status, x_dims, size, count, scratch, expanded
        if _count(dims) != count:
            if not expanded:
                expanded = True
                scratch = np.empty(max(count * size * (k_in - 1), 1), np.uint8)
            part = scratch[(j - 1) * count * size:j * count * size]
            _expand(data, dims, x_dims, part, size)
            data = part.ctypes.data
        job[JOB_IN + j] = data
    return 0, x_dims, size, count, scratch, expanded


@njit(inline="always", **_OPTIONS)
def _bind_outputs(fns, context, i, n, k_out, x_dims, job, out):
    """The output buffers of tensor ``i`` (X's shape) into the job; returns a status."""
    for j in range(k_out):
        status = _call5(fns[API_KERNEL_CONTEXT_GET_OUTPUT], context, np.int64(j * n + i),
                        x_dims.ctypes.data, np.int64(x_dims.size), out.ctypes.data)
        if status != 0:
            return status
        status = _call2(fns[API_GET_TENSOR_MUTABLE_DATA], out[0], out.ctypes.data)
        if status != 0:
            return status
        job[JOB_OUT + j] = out[0]
    return 0


@njit(inline="always", **_OPTIONS)
def _run_job(fns, state, context, job, count, size, expanded):
    """Run the job's element loop (the kind's worker for the dtype): in chunks on onnxruntime's
    thread pool when large (and not expanded), else here in one chunk. Returns a status."""
    job[JOB_N] = count
    worker = state[ST_CHUNK_F32] if size == 4 else state[ST_CHUNK_F64]
    if worker == 0:  # a dtype other than the one onnxruntime gave when it created the kernel
        return _error(fns, state, ERR_DTYPE)
    if count >= state[ST_PARALLEL_MIN] and not expanded:
        chunk = state[ST_CHUNK]
        job[JOB_CHUNK] = chunk
        return _call5(fns[API_KERNEL_CONTEXT_PARALLEL_FOR], context, worker,
                      np.int64((count + chunk - 1) // chunk), np.int64(0), job.ctypes.data)
    job[JOB_CHUNK] = max(count, 1)
    _call_void2(worker, np.int64(job.ctypes.data), _ZERO)
    return 0


@njit(**_OPTIONS)
def _compute(state_addr, context):
    """One node's step: check the arity, R and T, store them and the attributes in the job, then
    per tensor bind its inputs and outputs and run the kind's loop. Returns 0 or an OrtStatus."""
    state = carray(_ptr(state_addr, _I64), ST_WORDS)
    attrs = carray(_ptr(state_addr, np.float64(0)), ST_WORDS)[ST_ATTRS:ST_ATTRS + 8]
    fns = carray(_ptr(state[ST_API], _I64), API_TABLE_LENGTH)
    kind = state[ST_KIND]
    shape_reference = state[ST_SHAPE_REFERENCE]
    work = np.zeros(JOB_WORDS + 4, np.int64)  # one allocation: the job, then out-parameter scratch
    job = work[:JOB_WORDS]
    out = work[JOB_WORDS:]
    status, n_in, n_out = _counts(fns, context, out)
    if status != 0:
        return status
    k_in = 4 if kind == KIND_ADAM else 3
    k_out = k_in - 1
    n = (n_in - 2) // k_in
    if n_in < 2 + k_in or (n_in - 2) % k_in != 0 or n_out != n * k_out:
        return _error(fns, state, ERR_ARITY)
    status, r, t = _rate_and_count(fns, state, shape_reference, context, out)
    if status != 0:
        return status
    job[JOB_KIND] = kind
    job[JOB_T] = t
    jf = carray(_ptr(job.ctypes.data, np.float64(0)), JOB_WORDS)
    jf[JOB_R] = r
    for k in range(5):
        jf[JOB_ATTRS + k] = attrs[k]
    for i in range(n):
        status, x_dims, size, count, scratch, expanded = _bind_inputs(fns, state, shape_reference, context,
                                                                      i, n, k_in, job, out)
        if status == 0:
            status = _bind_outputs(fns, context, i, n, k_out, x_dims, job, out)
        if status == 0:
            status = _run_job(fns, state, context, job, count, size, expanded)
        _keep(scratch)  # the expanded inputs live until the update has run
        if status != 0:
            return status
    _keep(work)
    return 0


@lazy_cfunc(COMPUTE)
def optimizer_compute(state, context):
    """The compute function of every native optimizer node (its kind in the state): returns NULL
    or an OrtStatus naming the node."""
    return _compute(_addr(state), _addr(context))
