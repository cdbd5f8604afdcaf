"""Which kernels sessions get, and the SessionOptions that give them.

:func:`session_options` registers the kernel library (the native ops first, then the PyOps)
in a SessionOptions; :func:`select_kernels` says which path :func:`~onnx_training_ops.prepare`
targets: ``"native"`` where :func:`.native.availability` (a probe session checked against
the reference kernel) says it works, else ``"pyop"``.
"""

from __future__ import annotations

import logging
import os

import onnxruntime as ort

from ..errors import TrainingOpError
from . import native, plugin
from .extensions import extensions_library_path

_log = logging.getLogger(__name__)
_REGISTERED_MARK = "onnx_training_ops.custom_ops_library"  # a session-config entry marking registered options
KERNELS_ENV = "ONNX_TRAINING_OPS_KERNELS"
KERNEL_PATHS = ("native", "pyop")
_announced: set[str] = set()
# Up to this many trainable elements a training step is small: one intra-op thread (measured
# with benchmarks/bench_threads.py: MLP 64-128-10 0.48x the 2-thread step on the shared
# 2-core machine, within noise on a quiet one; README, "Performance").
SMALL_GRAPH_PARAMETERS = 100_000


def library_path() -> str:
    """Path of the onnxruntime-extensions custom-op library that hosts the kernels (registered
    first, so that options which register this path themselves see them)."""
    plugin.register()
    return extensions_library_path()


def session_options(so: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """SessionOptions with the training kernels' library registered (once, however often called).

    Args:
        so: options to register the library in; None makes new ones.

    Returns:
        ``so`` itself, or the new options.
    """
    plugin.register()
    so = so if so is not None else ort.SessionOptions()
    try:  # registering twice makes every session of these options fail ("Conflicting ... kernel")
        so.get_session_config_entry(_REGISTERED_MARK)
    except Exception:  # noqa: BLE001 - onnxruntime raises when the entry is absent
        _register_native()
        so.register_custom_ops_library(library_path())
        so.add_session_config_entry(_REGISTERED_MARK, "1")
    return so


def default_intra_op_threads(trainable_elements: int) -> int:
    """Intra-op threads for a training step that updates ``trainable_elements`` values: 1 for a
    small graph (waking a second thread costs more than it gains), else 0 (onnxruntime's
    default, one per physical core). Only used when the caller passes no SessionOptions."""
    return 1 if trainable_elements <= SMALL_GRAPH_PARAMETERS else 0


def _register_native() -> None:
    """Add the native kernels (:mod:`.native`) first, unless ``ONNX_TRAINING_OPS_KERNELS=pyop``."""
    if os.environ.get(KERNELS_ENV, "").strip().lower() != "pyop":
        native.register()


def select_kernels(kernels: str | None = None) -> str:
    """The kernel path :func:`onnx_training_ops.prepare` targets: ``"native"`` or ``"pyop"``.

    ``kernels`` (``"native"``, ``"pyop"``, ``"auto"``/None) else ``$ONNX_TRAINING_OPS_KERNELS``
    else ``"auto"``: native where :func:`.native.availability` says it works. Forcing ``"native"``
    where it does not work raises TrainingOpError. Logs the choice once per process."""
    requested = (kernels or os.environ.get(KERNELS_ENV) or "auto").strip().lower()
    if requested not in ("auto", *KERNEL_PATHS):
        raise TrainingOpError(f"kernels must be 'native', 'pyop' or 'auto', found {requested!r}")
    if requested == "pyop":
        path, note = "pyop", "requested"
    else:
        ok, reason = native.availability()
        if not ok and requested == "native":
            raise TrainingOpError(f"the native kernels were requested but do not work here: {reason}")
        path, note = ("native", "zero-copy, ai.onnx.contrib") if ok else ("pyop", f"native unavailable: {reason}")
    if path + note not in _announced:
        _announced.add(path + note)
        level = logging.WARNING if note.startswith("native unavailable") else logging.INFO
        _log.log(level, "onnx_training_ops: optimizer kernels: %s (%s)", path, note)
    return path
