"""``prepare``: a valid training-domain graph -> one that onnxruntime runs, by the pass pipeline
of the chosen kernels."""

from __future__ import annotations

from onnx import ModelProto

from ..passes import NATIVE_PASSES, PASSES, PORTABLE_PASSES
from ..storage.model_files import ModelLike, load_model
from . import plugin
from .options import select_kernels


def prepare(model: ModelLike, kernels: str | None = None, portable: bool = False) -> ModelProto:
    """Return a copy of ``model`` that a plain onnxruntime session (with :func:`session_options`) runs.

    Validates every node of ai.onnx.preview.training (raising TrainingOpError), expands
    Gradient nodes, fills default attributes, then targets the optimizer kernels: the
    native ones (nodes become ``ai.onnx.contrib::TrainingAdam`` etc.) or the PyOp ones
    (multi-tensor nodes split, exact attribute values stored); last, fits IR version and
    opsets to onnxruntime. ``kernels``: ``"native"``, ``"pyop"`` or ``None``/``"auto"``
    (the ``ONNX_TRAINING_OPS_KERNELS`` environment variable, else native where it works).
    Idempotent; nodes of other domains are left as they are. Registers the kernels with
    onnxruntime-extensions (so that options registering its library see them).

    ``portable=True`` (:data:`PORTABLE_PASSES`) lowers the optimizer nodes to standard ONNX
    ops instead: the result runs in any onnxruntime, or ``onnx.reference``, with nothing
    registered.
    """
    if portable:
        passes = PORTABLE_PASSES
    else:
        passes = NATIVE_PASSES if select_kernels(kernels) == "native" else PASSES
    result = load_model(model)
    for _, run_pass in passes:
        result = run_pass(result)
    if not portable:
        plugin.register()
    return result
