"""The ctypes side of onnxruntime's custom-op C API, shared by the native optimizers
(:mod:`.native`) and the native backward kernels (:mod:`.native_grads`): the
``OrtCustomOp`` struct, the callback types, the few ``OrtApi`` functions kernel creation
calls from Python, and what must outlive every session (structs, callbacks, strings);
:func:`cpu_custom_op` fills the struct both modules register.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from collections.abc import Callable, Sequence

import onnxruntime as ort

from ..errors import TrainingOpError

_log = logging.getLogger(__name__)

OP_VERSION = 16  # OrtCustomOp fields read up to KernelComputeV2 (CreateKernelV2/KernelComputeV2 need 16)
# ONNXTensorElementDataType, OrtCustomOpInputOutputCharacteristic
_UNDEFINED, _INT64 = 0, 7
_REQUIRED, _VARIADIC = 0, 2
_keepalive: list = []  # structs, callbacks and strings onnxruntime points to: never freed
_checked_apis: set[int] = set()  # OrtApi tables whose layout passed _Api.check

# Read shapes with GetTensorElementTypeAndShapeDataReference (API >= 24, no allocation) where
# the runtime has it; False forces the older GetTensorTypeAndShape route (tests cover both).
USE_SHAPE_REFERENCE = True


def api_version() -> int:
    """onnxruntime's C API version: its minor version (the extensions library reads it the same way)."""
    parts = ort.__version__.split(".")
    return int(parts[1]) if parts[0] == "1" and len(parts) > 1 and parts[1].isdigit() else 0


def shape_reference(api: int) -> int:
    """The kernels' ``ST_SHAPE_REFERENCE`` word: the address of
    GetTensorElementTypeAndShapeDataReference in the OrtApi table ``api``, 0 when not used."""
    from ..kernels import _ort_api as nk

    if not USE_SHAPE_REFERENCE or api_version() < nk.SHAPE_REFERENCE_API:
        return 0
    return ctypes.cast(api, ctypes.POINTER(ctypes.c_void_p))[nk.API_GET_TENSOR_ELEMENT_TYPE_AND_SHAPE_DATA_REFERENCE]


_c_op_p = ctypes.c_void_p
_FIELDS = (  # struct OrtCustomOp after ``uint32_t version``, in order (onnxruntime_c_api.h)
    "CreateKernel", "GetName", "GetExecutionProviderType", "GetInputType", "GetInputTypeCount",
    "GetOutputType", "GetOutputTypeCount", "KernelCompute", "KernelDestroy",
    "GetInputCharacteristic", "GetOutputCharacteristic",  # version >= 8
    "GetInputMemoryType",  # 11
    "GetVariadicInputMinArity", "GetVariadicInputHomogeneity",  # 14
    "GetVariadicOutputMinArity", "GetVariadicOutputHomogeneity",
    "CreateKernelV2", "KernelComputeV2",  # 16
    "InferOutputShapeFn", "GetStartVersion", "GetEndVersion",  # 17
    "GetMayInplace", "ReleaseMayInplace", "GetAliasMap", "ReleaseAliasMap",  # 18
)


class OrtCustomOp(ctypes.Structure):
    """``struct OrtCustomOp`` (all callbacks as plain addresses)."""

    _fields_ = [("version", ctypes.c_uint32)] + [(name, ctypes.c_void_p) for name in _FIELDS]


_GetName = ctypes.CFUNCTYPE(ctypes.c_void_p, _c_op_p)
_GetCount = ctypes.CFUNCTYPE(ctypes.c_size_t, _c_op_p)
_GetAt = ctypes.CFUNCTYPE(ctypes.c_int, _c_op_p, ctypes.c_size_t)
_GetInt = ctypes.CFUNCTYPE(ctypes.c_int, _c_op_p)
_CreateKernelV2 = ctypes.CFUNCTYPE(ctypes.c_void_p, _c_op_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.POINTER(ctypes.c_void_p))
# OrtApi entries called from Python (kernel creation only)
_CreateStatus = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
_GetErrorCode = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_GetErrorMessage = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)
_ReleaseStatus = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_GetAttrFloat = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float))
_GetAttrString = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_size_t))
_GetNodeName = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
_GetInputTypeInfo = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.POINTER(ctypes.c_void_p))
_CastToTensorInfo = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_GetElementType = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_ReleaseTypeInfo = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


# ---------------------------------------------------------------- the OrtApi table, from Python


class _Api:
    """The few ``OrtApi`` functions kernel creation calls, read from the live table."""

    def __init__(self, address: int) -> None:
        from ..kernels import _ort_api as nk

        table = ctypes.cast(address, ctypes.POINTER(ctypes.c_void_p))
        self.create_status = _CreateStatus(table[nk.API_CREATE_STATUS])
        self.get_error_code = _GetErrorCode(table[nk.API_GET_ERROR_CODE])
        self.get_error_message = _GetErrorMessage(table[nk.API_GET_ERROR_MESSAGE])
        self.release_status = _ReleaseStatus(table[nk.API_RELEASE_STATUS])
        self.get_attr_float = _GetAttrFloat(table[nk.API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT])
        self.get_attr_string = _GetAttrString(table[nk.API_KERNEL_INFO_GET_ATTRIBUTE_STRING])
        self.get_node_name = _GetNodeName(table[nk.API_KERNEL_INFO_GET_NODE_NAME])
        self.get_input_type_info = _GetInputTypeInfo(table[nk.API_KERNEL_INFO_GET_INPUT_TYPE_INFO])
        self.cast_to_tensor_info = _CastToTensorInfo(table[nk.API_CAST_TYPE_INFO_TO_TENSOR_INFO])
        self.get_element_type = _GetElementType(table[nk.API_GET_TENSOR_ELEMENT_TYPE])
        self.release_type_info = _ReleaseTypeInfo(table[nk.API_RELEASE_TYPE_INFO])

    def check(self) -> None:
        """Round-trip a status through the table: catches a layout we do not know."""
        status = self.create_status(2, b"onnx_training_ops probe")
        try:
            if self.get_error_code(status) != 2 or self.get_error_message(status) != b"onnx_training_ops probe":
                raise RuntimeError("the OrtApi table does not have the layout onnx_training_ops expects")
        finally:
            self.release_status(status)

    def status(self, message: str) -> int:
        return self.create_status(2, message.encode(errors="replace"))  # ORT_INVALID_ARGUMENT

    def float_attribute(self, info: int, name: str) -> float | None:
        value = ctypes.c_float()
        status = self.get_attr_float(info, name.encode(), ctypes.byref(value))
        if status:
            self.release_status(status)
            return None
        return float(value.value)

    def string_attribute(self, info: int, name: str) -> str | None:
        size = ctypes.c_size_t(0)
        status = self.get_attr_string(info, name.encode(), None, ctypes.byref(size))
        if status:
            self.release_status(status)
            return None
        buffer = ctypes.create_string_buffer(size.value + 1)
        status = self.get_attr_string(info, name.encode(), buffer, ctypes.byref(size))
        if status:
            self.release_status(status)
            return None
        return buffer.value.decode(errors="replace")

    def input_element_type(self, info: int, index: int) -> int | None:
        """The element type (ONNX's number) of the node's input ``index``, None when onnxruntime
        does not say (not a tensor, or an error)."""
        type_info, tensor_info, elem = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int(0)
        status = self.get_input_type_info(info, index, ctypes.byref(type_info))
        if status:
            self.release_status(status)
            return None
        try:
            status = self.cast_to_tensor_info(type_info, ctypes.byref(tensor_info))
            if status or not tensor_info.value:
                return None
            status = self.get_element_type(tensor_info, ctypes.byref(elem))
            return None if status else elem.value
        finally:
            if status:
                self.release_status(status)
            self.release_type_info(type_info)

    def node_name(self, info: int) -> str:
        size = ctypes.c_size_t(0)
        status = self.get_node_name(info, None, ctypes.byref(size))
        if status:
            self.release_status(status)
            return ""
        buffer = ctypes.create_string_buffer(size.value + 1)
        status = self.get_node_name(info, buffer, ctypes.byref(size))
        if status:
            self.release_status(status)
            return ""
        return buffer.value.decode(errors="replace")


_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        import ctypes.util

        _libc_handle = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc_handle.malloc.restype = ctypes.c_void_p
        _libc_handle.malloc.argtypes = [ctypes.c_size_t]
    return _libc_handle


def _free_address() -> int:
    address = ctypes.cast(_libc().free, ctypes.c_void_p).value
    if address is None:  # a NULL c_void_p reads as None
        raise TrainingOpError("libc's free has no address")
    return address


def kernel_state(compute: int, words: Sequence[int], strings: Sequence[bytes] = (),
                 slots: Sequence[int] = ()) -> int:
    """A ``malloc``-ed kernel state (freed by the destroy trampoline): the header of
    :mod:`onnx_training_ops.kernels._ort_api` (``compute``, libc's ``free``), then ``words``
    (int64), then ``strings`` (NUL-terminated), the address of each written into ``words[slots[k]]``.
    The op's compute function receives the address of ``words``.

    Args:
        compute: the address of the op's compute function, ``int64(state, context)``.
        words: the op's state words.
        strings: C strings stored after them.
        slots: for each string, the word that gets its address.

    Returns:
        The block's address: the kernel onnxruntime holds.
    """
    from ..kernels._ort_api import HEADER_BYTES

    words = list(words)
    size = HEADER_BYTES + 8 * len(words) + sum(len(text) for text in strings)
    memory = _libc().malloc(size)
    if not memory:
        raise MemoryError("cannot allocate a kernel state")
    offset = HEADER_BYTES + 8 * len(words)
    for slot, text in zip(slots, strings):
        words[slot] = memory + offset
        offset += len(text)
    block = struct.pack(f"<{2 + len(words)}q", compute, _free_address(), *words) + b"".join(strings)
    ctypes.memmove(memory, block, size)
    return memory


def _string(text: str) -> int:
    buffer = ctypes.create_string_buffer(text.encode())
    _keepalive.append(buffer)
    return ctypes.addressof(buffer)


def _kernel_creator(state: Callable[[int, int, _Api], int]) -> Callable:
    """A ``CreateKernelV2`` body: checks each ``OrtApi`` table once, stores ``state(api, info, calls)``
    (the address of the kernel's state) and returns any exception to onnxruntime as a status."""

    def create(op, api, info, kernel):
        try:
            calls = _Api(api)
        except Exception:  # noqa: BLE001 - cannot even build a status: report nothing, fail creation
            _log.error("onnx_training_ops: cannot read onnxruntime's OrtApi table")
            return None
        try:
            if api not in _checked_apis:
                calls.check()
                _checked_apis.add(api)
            kernel[0] = state(api, info, calls)
            return None
        except Exception as error:  # noqa: BLE001 - never let an exception reach onnxruntime
            return calls.status(str(error))

    return create


def cpu_custom_op(name: str, input_types: Callable[[int], int], input_count: int,
                  output_types: Callable[[int], int], output_count: int,
                  characteristics: tuple[Callable[[int], int], Callable[[int], int]],
                  min_arities: tuple[int, int], state: Callable[[int, int, _Api], int]) -> OrtCustomOp:
    """An ``OrtCustomOp`` of the CPU execution provider, kept alive for the process.

    Args:
        name: the op type.
        input_types: the element type of input ``i`` (``_UNDEFINED``: any).
        input_count: how many formal inputs.
        output_types: the element type of output ``i``.
        output_count: how many formal outputs.
        characteristics: of input ``i`` and of output ``i`` (``_REQUIRED`` or ``_VARIADIC``).
        min_arities: the least number of values of a variadic input and of a variadic output.
        state: given the ``OrtApi`` address, the kernel info and the ``OrtApi`` calls, the address of a
            new kernel's state made by :func:`kernel_state` (its errors become onnxruntime statuses);
            onnxruntime calls the shared trampolines, which run the compute function it names.

    Returns:
        The filled struct.
    """
    name_c, provider = _string(name), _string("CPUExecutionProvider")
    callbacks = {
        "GetName": _GetName(lambda op: name_c),
        "GetExecutionProviderType": _GetName(lambda op: provider),
        "GetInputType": _GetAt(lambda op, i: input_types(i)),
        "GetInputTypeCount": _GetCount(lambda op: input_count),
        "GetOutputType": _GetAt(lambda op, i: output_types(i)),
        "GetOutputTypeCount": _GetCount(lambda op: output_count),
        "GetInputCharacteristic": _GetAt(lambda op, i: characteristics[0](i)),
        "GetOutputCharacteristic": _GetAt(lambda op, i: characteristics[1](i)),
        "GetInputMemoryType": _GetAt(lambda op, i: 0),  # OrtMemTypeDefault
        "GetVariadicInputMinArity": _GetInt(lambda op: min_arities[0]),
        "GetVariadicInputHomogeneity": _GetInt(lambda op: 1),
        "GetVariadicOutputMinArity": _GetInt(lambda op: min_arities[1]),
        "GetVariadicOutputHomogeneity": _GetInt(lambda op: 1),
        "CreateKernelV2": _CreateKernelV2(_kernel_creator(state)),
    }
    op = OrtCustomOp()
    op.version = OP_VERSION
    for field, callback in callbacks.items():
        setattr(op, field, ctypes.cast(callback, ctypes.c_void_p).value)
    from ..kernels import _ort_api

    op.KernelComputeV2 = _ort_api.kernel_compute.address
    op.KernelDestroy = _ort_api.kernel_destroy.address
    _keepalive.extend([op, callbacks])
    return op
