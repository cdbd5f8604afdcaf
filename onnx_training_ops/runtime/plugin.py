"""The one place that talks to onnxruntime-extensions: PyOp registration and the invocation hook.

Each optimizer is registered once per (R dtype, X dtype) pair in {float, double}², with
the per-tensor arity (the ``split_multi_tensor_nodes`` pass makes every node per-tensor).

Two facts about the PyOp bridge shape this module (see DESIGN.md §2):

* float attributes reach Python as 6-digit text, so the kernels read one declared string
  attribute, ``exact_attributes`` (written by the ``encode_exact_attributes`` pass), that
  holds every attribute exactly (``float.hex`` of the float32 value in the model);
* the default invocation hook turns outputs into Python lists. We install a hook that
  returns contiguous arrays for our ops and hands every other PyOp to the original hook,
  so other users' PyOps (string outputs included) keep working.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import TrainingOpError
from ..kernels.apply import STEPS
from ..passes.encode_exact_attributes import EXACT_ATTRIBUTE, decode_attributes
from ..schema import DOMAIN, OPTIMIZERS
from .extensions import extensions_pyop_module

_registered_ids: set[int] = set()
_register_lock = threading.Lock()
_opdefs: dict = {}  # id -> onnxruntime_extensions' Opdef of our kernels
_previous_hook: Callable[..., Any] | None = None  # onnxruntime-extensions' own, set with ours
_log = logging.getLogger(__name__)

# A Python exception must never leave the hook: the bridge would terminate the process.
# A failing kernel instead logs the error, records it for the calling thread (onnxruntime runs
# the kernel on the thread that called run()) and returns NaN outputs;
# onnx_training_ops.InferenceSession turns the record into an exception after run(). A
# KeyboardInterrupt (Ctrl-C) arriving inside a kernel is recorded the same way and re-raised
# after run() returns. Records are per thread and bounded: a plain onnxruntime session that
# never collects them cannot make them grow.
MAX_RECORDS = 16
_records = threading.local()


class Interrupted(Exception):
    """Marks a KeyboardInterrupt caught inside a kernel, re-raised after the run."""


def _thread_records() -> deque:
    records = getattr(_records, "errors", None)
    if records is None:
        records = _records.errors = deque(maxlen=MAX_RECORDS)
    return records


def take_kernel_errors() -> list[Exception]:
    """The kernel errors recorded on this thread since the last call (and forget them).

    After a plain ``onnxruntime.InferenceSession.run`` on a prepared model (whose failed
    kernels return NaN and log the error), this is how the caller learns what failed."""
    records = _thread_records()
    errors = list(records)
    records.clear()
    return errors


def _make_kernel(op_type: str):
    step = STEPS[op_type]

    def kernel(r, t, *tensors, exact_attributes: str):
        # Inputs arrive as fresh copies owned by this call, so updating them in place is safe.
        return step(r, t, *tensors, decode_attributes(exact_attributes), inplace=True)

    kernel.__name__ = f"{op_type.lower()}_kernel"
    return kernel


def _hook(k_id, feed, attributes):
    if k_id not in _registered_ids:
        assert _previous_hook is not None, "installed after onnxruntime-extensions' own is kept"
        return _previous_hook(k_id, feed, attributes)
    opdef = _opdefs[k_id]
    try:
        try:
            outputs = opdef.body(*feed, **opdef.cast_attributes(attributes))
        except Exception as error:  # noqa: BLE001 - anything escaping here kills the process
            outputs = _failed_outputs(opdef, feed, attributes, error)
        return _packed(k_id, outputs)
    except KeyboardInterrupt:  # Ctrl-C landed in Python code here: re-raised after the run
        return _packed(k_id, _failed_outputs(opdef, feed, attributes,
                                             Interrupted("KeyboardInterrupt")))


def _packed(k_id, outputs) -> tuple:
    result = [k_id]
    for out in outputs:
        out = np.asarray(out)
        result.append(out.shape)
        result.append(np.ascontiguousarray(out).reshape(-1))  # flat data; the shape travels beside it
    return tuple(result)


def _failed_outputs(opdef, feed, attributes: dict, error: Exception) -> list[np.ndarray]:
    """NaN outputs shaped like X, after recording and logging ``error`` (re-worded to name the node)."""
    op_type = opdef.op_type.split("::")[-1]
    try:
        node = decode_attributes(attributes[EXACT_ATTRIBUTE]).get("node", "")
    except Exception:  # noqa: BLE001
        node = ""
    if not isinstance(error, Interrupted):
        detail = str(error).removeprefix(f"{op_type}: ")
        error = TrainingOpError(f"{op_type} node {node!r}: {detail}")
        _log.error("%s", error)
    _thread_records().append(error)
    x = np.asarray(feed[2]) if len(feed) > 2 else np.zeros(())
    dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float32
    return [np.full(x.shape, np.nan, dtype) for _ in range(OPTIMIZERS[op_type].n_groups_out)]


def register() -> None:
    """Register the optimizers with onnxruntime-extensions (idempotent; done by
    :func:`.options.session_options`, :func:`.options.library_path` and ``prepare``, not on
    import)."""
    with _register_lock:  # two sessions opened in two threads: one registration, complete before either runs
        if not _registered_ids:
            _register()


def _register() -> None:
    global _previous_hook
    _ocos = extensions_pyop_module()
    PyCustomOpDef, onnx_op = _ocos.PyCustomOpDef, _ocos.Opdef.declare

    float_types = (PyCustomOpDef.dt_float, PyCustomOpDef.dt_double)
    for op_type, spec in OPTIMIZERS.items():
        for r_type in float_types:
            for x_type in float_types:
                opdef = onnx_op(
                    op_type=f"{DOMAIN}::{op_type}",
                    inputs=[r_type, PyCustomOpDef.dt_int64] + [x_type] * spec.n_groups_in,
                    outputs=[x_type] * spec.n_groups_out,
                    attrs={EXACT_ATTRIBUTE: PyCustomOpDef.dt_string},
                )(_make_kernel(op_type))
                _registered_ids.add(id(opdef))
                _opdefs[id(opdef)] = opdef
    _previous_hook = _ocos._on_pyop_invocation
    PyCustomOpDef.install_hooker(_hook)


def keep_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """Opt-in: let glibc malloc keep freed large blocks for reuse instead of unmapping them.

    The PyOp bridge copies every input into a freshly allocated numpy array on each call.
    glibc serves large blocks with mmap and returns them on free, so each call page-faults
    its inputs in again: for a 1e7-parameter Adam node that is about a third of the call.
    This raises glibc's mmap and trim thresholds (process-wide) so that the same memory is
    reused. Peak memory then stays resident. Returns False where it does not apply
    (not glibc) — nothing changes then.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    limit = int(min(limit_bytes, (1 << 31) - 1))
    return bool(mallopt(m_mmap_threshold, limit)) and bool(mallopt(m_trim_threshold, limit))
