"""The plumbing every native (cfunc) kernel shares: onnxruntime's C API called from numba.

Functions of the ``OrtApi`` table are called through their addresses (read from the table at
run time, by index: the table is append-only, so an index written from the documented C API
stays valid in every later onnxruntime), with all arguments passed as 64-bit integers
(pointers, ``size_t`` and the ``int`` enums all travel in integer registers on the 64-bit
Linux/macOS ABIs). Used by :mod:`._native_kernels` (optimizers), :mod:`._native_grad_kernels`
and :mod:`._native_norm_kernels`.

**Compiled on first use.** Their C entry points are :class:`LazyCFunc`: importing a kernel
module compiles nothing, and a cfunc is compiled (or loaded from numba's disk cache) the first
time its address is read, when onnxruntime creates a kernel of that op (its ``CreateKernelV2``
runs in Python). A model with one Adam node compiles Adam's kernels, not the convolution's.
Every registered op points onnxruntime at the same two small trampolines,
:data:`kernel_compute` and :data:`kernel_destroy`: a kernel's state block starts with a
header (``HEADER_WORDS``: the address of the op's own compute function and of ``free``) and
the trampoline calls the op's function on the state after the header.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core.ccallback import CFunc
from numba.core.typing import Signature
from numba.extending import intrinsic

from ..optim._numba import OPTIONS, JitOptions, cache_covers_inlined_sources
from .compile_notice import announce_compiles

cache_covers_inlined_sources()  # the native kernels' caches cover the sources they inline

# ---- OrtApi function indices (0-based position in struct OrtApi, onnxruntime_c_api.h) ----
API_CREATE_STATUS = 0
API_GET_ERROR_CODE = 1
API_GET_ERROR_MESSAGE = 2
API_GET_TENSOR_MUTABLE_DATA = 51
API_CAST_TYPE_INFO_TO_TENSOR_INFO = 55
API_GET_TENSOR_ELEMENT_TYPE = 60
API_GET_DIMENSIONS_COUNT = 61
API_GET_DIMENSIONS = 62
API_GET_TENSOR_SHAPE_ELEMENT_COUNT = 64
API_GET_TENSOR_TYPE_AND_SHAPE = 65
API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85
API_KERNEL_INFO_GET_ATTRIBUTE_STRING = 87
API_KERNEL_CONTEXT_GET_INPUT_COUNT = 88
API_KERNEL_CONTEXT_GET_OUTPUT_COUNT = 89
API_KERNEL_CONTEXT_GET_INPUT = 90
API_KERNEL_CONTEXT_GET_OUTPUT = 91
API_RELEASE_STATUS = 93
API_RELEASE_TYPE_INFO = 98
API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99
API_KERNEL_INFO_GET_INPUT_TYPE_INFO = 234  # since API 12
API_KERNEL_INFO_GET_NODE_NAME = 244  # since API 15
API_KERNEL_CONTEXT_PARALLEL_FOR = 274  # since API 17
API_GET_TENSOR_ELEMENT_TYPE_AND_SHAPE_DATA_REFERENCE = 414  # since API 24: no allocation
API_TABLE_LENGTH = 275  # entries read through the table (index 414 is read only where it exists)
SHAPE_REFERENCE_API = 24

ORT_INVALID_ARGUMENT = 2
ELEM_FLOAT, ELEM_INT64, ELEM_DOUBLE = 1, 7, 11

_i64 = ir.IntType(64)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _nopython(returns: type[_R]) -> Callable[[Callable[Concatenate[Any, _P], object]], Callable[_P, _R]]:
    """numba's ``@intrinsic``, typed as its result is called: from nopython code only, without the
    typing context, returning ``returns`` (numba's stubs type the call from Python, which raises)."""

    def decorate(defn: Callable[Concatenate[Any, _P], object]) -> Callable[_P, _R]:
        return cast("Callable[_P, _R]", intrinsic(defn))

    return decorate


@_nopython(ctypes._Pointer)
def _ptr(typingctx, addr, like):
    """``addr`` (int64) as a pointer to ``like``'s type, for ``carray``."""
    ptr_type = types.CPointer(like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_type))

    return ptr_type(types.int64, like), codegen


@_nopython(int)
def _addr(typingctx, pointer):
    """A ``voidptr`` as int64."""

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], _i64)

    return types.int64(types.voidptr), codegen


def _make_call(n_args: int, void: bool):
    """An intrinsic calling the C function at address ``fn`` with ``n_args`` int64 arguments."""

    def call(typingctx, fn, *args):
        if len(args) != n_args:
            return None
        signature = (types.void if void else types.int64)(*([types.int64] * (n_args + 1)))

        def codegen(context, builder, sig, llargs):
            fnty = ir.FunctionType(ir.VoidType() if void else _i64, [_i64] * n_args)
            target = builder.inttoptr(llargs[0], fnty.as_pointer())
            result = builder.call(target, list(llargs[1:]))
            return context.get_dummy_value() if void else result

        return signature, codegen

    return call


# numba's @intrinsic wants a fixed parameter list: spell out the arities used
@_nopython(int)
def _call2(typingctx, fn, a, b):
    return _make_call(2, False)(typingctx, fn, a, b)


@_nopython(int)
def _call3(typingctx, fn, a, b, c):
    return _make_call(3, False)(typingctx, fn, a, b, c)


@_nopython(int)
def _call4(typingctx, fn, a, b, c, d):
    return _make_call(4, False)(typingctx, fn, a, b, c, d)


@_nopython(int)
def _call5(typingctx, fn, a, b, c, d, e):
    return _make_call(5, False)(typingctx, fn, a, b, c, d, e)


@_nopython(type(None))
def _call_void1(typingctx, fn, a):
    return _make_call(1, True)(typingctx, fn, a)


@_nopython(type(None))
def _call_void2(typingctx, fn, a, b):
    return _make_call(2, True)(typingctx, fn, a, b)


_I64 = np.int64(0)

_OPTIONS: JitOptions = {"nogil": True, "cache": True, **OPTIONS}  # every native kernel's numba options
COMPUTE = types.int64(types.voidptr, types.voidptr)  # KernelComputeV2(state, context) -> OrtStatus*
WORKER = types.void(types.voidptr, types.uintp)  # KernelContext_ParallelFor's task(job, index)

_compile_lock = threading.RLock()


class LazyCFunc:
    """A numba ``cfunc`` compiled, or loaded from numba's disk cache, the first time its
    :attr:`address` is read (under the compile notice: a real compile says so on stderr once).

    Args:
        signature: the C signature (a numba function type).
        func: the Python function to compile (module level: numba's cache finds it by name).
    """

    def __init__(self, signature: Signature, func: Callable[..., object]) -> None:
        self.signature, self.func = signature, func
        self.compiled: CFunc[Any] | None = None
        self.__doc__, self.__name__ = func.__doc__, func.__name__

    @property
    def address(self) -> int:
        """The C function's address (compiled now if it is not yet)."""
        compiled = self.compiled
        if compiled is None:
            with _compile_lock, announce_compiles():
                compiled = self.compiled
                if compiled is None:
                    compiled = self.compiled = _compile(self.signature, self.func)
        address = compiled.address
        assert address is not None, "a compiled cfunc has an address"
        return address

    @property
    def cache_hits(self) -> int:
        """numba's cache-hit counter of the compiled function (empty before the first use)."""
        return self.compiled.cache_hits if self.compiled is not None else 0


_uncached_warned = False


def _compile(signature: Signature, func: Callable[..., object]) -> CFunc[Any]:
    """``cfunc`` with numba's disk cache; where no cache directory is writable (numba raises at
    decoration), compiled for this process only, with one warning naming NUMBA_CACHE_DIR."""
    global _uncached_warned
    try:
        return _cfunc(signature, func, _OPTIONS)
    except RuntimeError as error:  # "cannot cache function ...: no locator available"
        if "cache" not in str(error):
            raise
        if not _uncached_warned:
            import warnings

            _uncached_warned = True
            warnings.warn(f"numba cannot cache the native kernels ({error}); compiling them once per process. "
                          "Set NUMBA_CACHE_DIR to a writable directory to keep them between runs", stacklevel=3)
        return _cfunc(signature, func, {**_OPTIONS, "cache": False})


def _cfunc(signature: Signature, func: Callable[..., object], options: JitOptions) -> CFunc[Any]:
    # numba's stubs leave boundscheck out of cfunc's options; the compiler honours it as it does njit's
    return cfunc(signature, **options)(func)  # type: ignore[misc]


def lazy_cfunc(signature: Signature) -> Callable[[Callable[..., object]], LazyCFunc]:
    """Decorate a module-level function as a :class:`LazyCFunc` of ``signature``."""
    return lambda func: LazyCFunc(signature, func)


# ---- the kernel state header and the trampolines every registered op points onnxruntime at ----

HDR_COMPUTE, HDR_FREE = 0, 1  # the op's compute function(state after the header, context); libc's free
HEADER_WORDS = 2
HEADER_BYTES = 8 * HEADER_WORDS


def _compute_trampoline(op_kernel, context):
    """``OrtCustomOp.KernelComputeV2`` of every native op: the op's own compute, on its state."""
    kernel = _addr(op_kernel)
    header = carray(_ptr(kernel, _I64), HEADER_WORDS)
    return _call2(header[HDR_COMPUTE], kernel + HEADER_BYTES, _addr(context))


def _destroy_trampoline(op_kernel):
    """``OrtCustomOp.KernelDestroy`` of every native op: frees the state with the ``free`` it names."""
    kernel = _addr(op_kernel)
    _call_void1(carray(_ptr(kernel, _I64), HEADER_WORDS)[HDR_FREE], kernel)


kernel_compute = LazyCFunc(COMPUTE, _compute_trampoline)
kernel_destroy = LazyCFunc(types.void(types.voidptr), _destroy_trampoline)


@njit(**_OPTIONS)
def _tensor(fns, shape_reference, value, out):
    """Element type, dims and data address of an OrtValue tensor.

    Returns ``(status, elem_type, dims, data)``; ``out`` is scratch for the out-parameters.
    With ``shape_reference`` (API >= 24) ``dims`` views onnxruntime's own shape: no allocation."""
    out_addr = out.ctypes.data
    if shape_reference != 0:
        out[0] = 0
        status = _call4(shape_reference, value, out_addr, out_addr + 8, out_addr + 16)
        if status != 0:
            return status, 0, carray(_ptr(0, _I64), 0), 0
        elem = out[0] & 0xFFFFFFFF
        dims = carray(_ptr(out[1], _I64), out[2])
    else:
        dims = carray(_ptr(0, _I64), 0)
        status = _call2(fns[API_GET_TENSOR_TYPE_AND_SHAPE], value, out_addr)
        if status != 0:
            return status, 0, dims, 0
        info = out[0]
        status = _call2(fns[API_GET_TENSOR_ELEMENT_TYPE], info, out_addr)
        elem = out[0] & 0xFFFFFFFF
        if status == 0:
            status = _call2(fns[API_GET_DIMENSIONS_COUNT], info, out_addr)
        if status == 0:
            dims = np.empty(out[0], np.int64)
            status = _call3(fns[API_GET_DIMENSIONS], info, dims.ctypes.data, np.int64(dims.size))
        _call_void1(fns[API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO], info)
        if status != 0:
            return status, 0, dims, 0
    status = _call2(fns[API_GET_TENSOR_MUTABLE_DATA], value, out_addr)
    return status, elem, dims, out[0]


@njit(**_OPTIONS)
def _input(fns, shape_reference, context, index, out):
    status = _call3(fns[API_KERNEL_CONTEXT_GET_INPUT], context, np.int64(index), out.ctypes.data)
    if status != 0:
        return status, 0, carray(_ptr(0, _I64), 0), 0
    return _tensor(fns, shape_reference, out[0], out)


@njit(inline="always", **_OPTIONS)
def _count(dims):
    n = 1
    for d in dims:
        n *= d
    return n


@njit(**_OPTIONS)
def _broadcasts_to(dims, target):
    """True when a tensor of ``dims`` broadcasts to ``target`` (numpy rules, result ``target``)."""
    if dims.size > target.size:
        return False
    lead = target.size - dims.size
    for k in range(dims.size):
        if dims[k] != 1 and dims[k] != target[lead + k]:
            return False
    return True


@njit(**_OPTIONS)
def _expand(src, dims, target, dst, size):
    """Copy the tensor at address ``src`` (shape ``dims``) broadcast to ``target`` into the
    contiguous buffer ``dst`` (``size`` bytes per element)."""
    nd = target.size
    strides = np.zeros(nd, np.int64)  # source strides in elements, 0 along broadcast axes
    lead = nd - dims.size
    step = 1
    for k in range(dims.size - 1, -1, -1):
        if dims[k] != 1:
            strides[lead + k] = step
        step *= dims[k]
    index = np.zeros(nd, np.int64)
    source = carray(_ptr(src, np.uint8(0)), max(step, 1) * size)
    n = _count(target)
    offset = 0
    for i in range(n):
        for b in range(size):
            dst[i * size + b] = source[offset * size + b]
        for k in range(nd - 1, -1, -1):  # odometer over target's index, source offset beside it
            index[k] += 1
            offset += strides[k]
            if index[k] < target[k]:
                break
            offset -= strides[k] * target[k]
            index[k] = 0


@njit(inline="always", **_OPTIONS)
def _keep(a):
    return a.size
