"""Native optimizer kernels: numba ``cfunc`` kernels registered as ``OrtCustomOp`` structs
through onnxruntime-extensions' exported ``AddExternalCustomOp`` (with them, the native
backward kernels of :mod:`.native_grads`).

Ops added that way are registered in the ``ai.onnx.contrib`` domain the next time
``SessionOptions.register_custom_ops_library(get_library_path())`` runs, so
:func:`onnx_training_ops.prepare` rewrites ``ai.onnx.preview.training::Adam`` into
``ai.onnx.contrib::TrainingAdam`` (likewise Momentum, Adagrad) when it targets this path.
The names differ from the PyOps' (``Adam``...) on purpose: the extensions library skips an
external op whose name a PyOp already has, and in 0.15 that skip loops forever.

Unlike the PyOp bridge, which copies every input into a new numpy array and every output
back, these kernels read onnxruntime's input buffers and write its output buffers
directly, run a multi-tensor node in one call (inputs and outputs are variadic) and split
large tensors over onnxruntime's intra-op thread pool. Errors come back as an
``OrtStatus`` naming the node; onnxruntime raises it from ``run``.

What is checked before anything is registered (:func:`availability`): a 64-bit POSIX
platform, the ``AddExternalCustomOp`` symbol, onnxruntime's C API version (>= 17 for
``KernelContext_ParallelFor``), and a probe session (the smallest native kernel) whose result
must equal numpy's. The ``OrtApi`` table is checked again on the live pointer when the first kernel is
created (``CreateStatus``/``GetErrorCode``/``GetErrorMessage`` round trip). Any failure:
one log line, and :func:`onnx_training_ops.prepare` targets the PyOp path.

Everything built here (structs, callbacks, strings) lives in module globals until the
process ends: onnxruntime keeps pointers to them in every session and every
``SessionOptions`` the library was registered in.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import sys
import threading

import numpy as np
import onnxruntime as ort

from ..passes.target_native import NATIVE_DOMAIN, NATIVE_OP_TYPES
from ..schema import OPTIMIZERS
from .custom_op import (
    _INT64,
    _REQUIRED,
    _UNDEFINED,
    _VARIADIC,
    OrtCustomOp,
    _Api,
    _keepalive,
    cpu_custom_op,
    kernel_state,
    shape_reference,
)
from .custom_op import api_version as _api_version
from .extensions import extensions_library_path

_log = logging.getLogger(__name__)

MIN_API_VERSION = 17  # KernelContext_ParallelFor
PARALLEL_MIN = 1 << 15  # elements: below, one thread (waking the pool costs more)
CHUNK = 1 << 16  # elements per ParallelFor task


lock = threading.RLock()  # registration and the availability probe, one thread at a time
_availability: tuple[bool, str] | None = None
_registered = False


# ---------------------------------------------------------------- kernel creation


_ATTRIBUTES = {  # state attribute slots, in order
    "Adam": ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post"),
    "Momentum": ("alpha", "beta", "norm_coefficient"),
    "Adagrad": ("decay_factor", "epsilon", "norm_coefficient"),
}


def _messages(op_type: str, node: str) -> list[str]:
    """The kernel's error messages, indexed by ``ERR_*`` (each names the node)."""
    spec = OPTIMIZERS[op_type]
    groups = ", ".join(spec.tensor_inputs)
    label = f"{op_type} node {node!r}"
    return [
        f"{label}: expected R, T and then {spec.n_groups_in}*N tensors ({groups} per optimized tensor) "
        f"and {spec.n_groups_out}*N outputs",
        f"{label}: input 'R' must be a float32/float64 scalar of shape [] or [1]",
        f"{label}: input 'T' must be an int64 scalar of shape [] or [1]",
        f"{label}: inputs {groups} of each optimized tensor must share one dtype, float32 or float64",
        f"{label}: the shapes of {', '.join(spec.tensor_inputs[1:])} must broadcast to the shape of "
        f"{spec.tensor_inputs[0]!r}",
    ]


def _state_block(op_type: str, api: int, info: int, calls: _Api) -> int:
    """A kernel state for one node (see ``ST_*`` in ``_native_kernels``). The first node of a
    kind compiles (or loads from numba's cache) the shared compute function and that kind's
    loop for the node's dtype (both loops when onnxruntime does not say which)."""
    from ..kernels import _native_kernels as nk

    node = calls.node_name(info)
    spec = OPTIMIZERS[op_type]
    kind = {"Adam": nk.KIND_ADAM, "Momentum": nk.KIND_MOMENTUM, "Adagrad": nk.KIND_ADAGRAD}[op_type]
    if op_type == "Momentum":
        mode = calls.string_attribute(info, "mode")
        if mode not in ("standard", "nesterov"):
            raise ValueError(f"Momentum node {node!r}: attribute 'mode' must be 'standard' or 'nesterov', "
                             f"found {mode!r}")
        kind = nk.KIND_NESTEROV if mode == "nesterov" else nk.KIND_MOMENTUM
    attrs = []
    for name in _ATTRIBUTES[op_type]:
        value = calls.float_attribute(info, name)
        if value is None:
            if name not in spec.defaults:
                raise ValueError(f"{op_type} node {node!r}: attribute {name!r} is required")
            value = float(spec.defaults[name])
        attrs.append(value)
    elem = calls.input_element_type(info, 2)  # X of the first tensor: the inputs after R, T share its type
    f32, f64 = nk.WORKERS[kind]
    words = [0] * nk.ST_WORDS
    words[nk.ST_API] = api
    words[nk.ST_KIND] = kind
    words[nk.ST_CHUNK_F32] = f32.address if elem != nk.ELEM_DOUBLE else 0  # 0: the dtype error, never called
    words[nk.ST_CHUNK_F64] = f64.address if elem != nk.ELEM_FLOAT else 0
    words[nk.ST_PARALLEL_MIN] = PARALLEL_MIN
    words[nk.ST_CHUNK] = CHUNK
    words[nk.ST_SHAPE_REFERENCE] = shape_reference(api)
    for k, value in enumerate(attrs):
        words[nk.ST_ATTRS + k] = struct.unpack("<q", struct.pack("<d", value))[0]
    messages = [m.encode(errors="replace") + b"\0" for m in _messages(op_type, node)]
    return kernel_state(nk.optimizer_compute.address, words, messages,
                        [nk.ST_MESSAGES + k for k in range(len(messages))])


# ---------------------------------------------------------------- the OrtCustomOp structs


def _custom_op(op_type: str) -> OrtCustomOp:
    """An ``OrtCustomOp`` for ``op_type``: inputs ``R`` (float/double), ``T`` (int64),
    then the tensors (variadic, one element type); outputs variadic, one element type."""
    spec = OPTIMIZERS[op_type]
    input_types = (_UNDEFINED, _INT64, _UNDEFINED)
    return cpu_custom_op(
        NATIVE_OP_TYPES[op_type],
        input_types=lambda i: input_types[i] if i < 3 else _UNDEFINED, input_count=3,
        output_types=lambda i: _UNDEFINED, output_count=1,
        characteristics=(lambda i: _VARIADIC if i == 2 else _REQUIRED, lambda i: _VARIADIC),
        min_arities=(spec.n_groups_in, spec.n_groups_out),
        state=functools.partial(_state_block, op_type))


# ---------------------------------------------------------------- availability and registration


def _extensions_library():
    return ctypes.CDLL(extensions_library_path())


def unavailable_reason() -> str:
    """Why the native path cannot work here ('' when nothing is known against it)."""
    if os.name != "posix" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return "needs a 64-bit Linux or macOS process"
    if _api_version() < MIN_API_VERSION:
        return f"onnxruntime {ort.__version__} is older than 1.{MIN_API_VERSION}"
    try:
        library = _extensions_library()
    except Exception as error:  # noqa: BLE001
        return f"cannot load the onnxruntime-extensions library: {error}"
    if not hasattr(library, "AddExternalCustomOp"):
        return "the onnxruntime-extensions library does not export AddExternalCustomOp"
    try:  # the modules only: each kernel compiles (or loads from numba's cache) when first used
        from ..kernels import _native_grad_kernels, _native_kernels, _native_norm_kernels  # noqa: F401
    except Exception as error:  # noqa: BLE001
        return f"cannot load the numba kernels: {error}"
    return ""


def register() -> bool:
    """Add the native ops to onnxruntime-extensions (once per process); True when added.

    Call before ``register_custom_ops_library``: options registered earlier lack them."""
    global _registered
    with lock:
        if _registered:
            return True
        if unavailable_reason():
            return False
        library = _extensions_library()
        library.AddExternalCustomOp.restype = ctypes.c_bool
        library.AddExternalCustomOp.argtypes = [ctypes.c_void_p]
        from .native_grads import custom_ops

        ops = [(t, _custom_op(t)) for t in NATIVE_OP_TYPES] + [("backward kernels", o) for o in custom_ops()]
        for label, op in ops:
            if not library.AddExternalCustomOp(ctypes.addressof(op)):
                _log.warning("onnx_training_ops: AddExternalCustomOp refused %s", label)
                return False
        _keepalive.append(library)
        _registered = True
        return True


def availability() -> tuple[bool, str]:
    """``(True, '')`` when the native kernels run here, else ``(False, reason)`` (probed once)."""
    global _availability
    with lock:
        if _availability is None:
            reason = unavailable_reason()
            if not reason:
                try:
                    reason = _probe()
                except Exception as error:  # noqa: BLE001
                    reason = f"the probe session failed: {error}"
            _availability = (not reason, reason)
        return _availability


def _probe() -> str:
    """Run the smallest native kernel (TrainingReluGrad, one thread and split over onnxruntime's
    thread pool: what every native kernel goes through, from registration and kernel creation to
    the OrtApi calls); '' when its results equal numpy's. A small kernel: the probe compiles
    about a second of code on a first run, the optimizers compile when a model first uses them."""
    from onnx import TensorProto, helper

    from ..autodiff.native_ops import RELU_GRAD
    from .native_grads import RELU_PARALLEL_MIN

    if not register():
        return "registration failed"
    sizes = {"small": 5, "large": RELU_PARALLEL_MIN + 5}
    nodes, inputs, outputs = [], [], []
    for label, n in sizes.items():
        dy, y, dx = (helper.make_tensor_value_info(f"{v}_{label}", TensorProto.FLOAT, [n]) for v in ["dy", "y", "dx"])
        nodes.append(helper.make_node(RELU_GRAD, [dy.name, y.name], [dx.name], domain=NATIVE_DOMAIN,
                                      name=f"probe_{label}"))
        inputs += [dy, y]
        outputs.append(dx)
    graph = helper.make_graph(nodes, "probe", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal(i.type.tensor_type.shape.dim[0].dim_value).astype(np.float32)
             for i in inputs}
    so = ort.SessionOptions()  # the native ops only: what the probe runs
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(extensions_library_path())
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    want = [feeds[f"dy_{label}"] * (feeds[f"y_{label}"] > 0) for label in sizes]
    if not all(np.array_equal(a, b) for a, b in zip(got, want)):
        return "the probe session's result differs from numpy's"
    return ""


def native_error_message(error: BaseException) -> str | None:
    """The native kernel's own message inside an onnxruntime exception, or None."""
    text = str(error)
    marker = "Status Message: "
    if marker not in text:
        return None
    message = text.split(marker, 1)[1].strip()
    if not any(message.startswith(f"{op} node ") for op in NATIVE_OP_TYPES):
        return None
    return message


__all__ = ["NATIVE_DOMAIN", "NATIVE_OP_TYPES", "OrtCustomOp", "availability", "native_error_message", "register"]

if sys.byteorder != "little":  # pragma: no cover - the state block is written little-endian
    unavailable_reason = lambda: "needs a little-endian machine"  # noqa: E731
