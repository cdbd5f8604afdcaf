"""``prepare``: a valid training-domain graph -> one that onnxruntime runs, by the pass pipeline
of the chosen kernels."""

from __future__ import annotations

from onnx import ModelProto

from ..passes import NATIVE_PASSES, PASSES, PORTABLE_PASSES
from ..storage.large_model import LargeModel
from ..storage.tensors import proto_of
from ..storage.model_files import ModelLike, load_model
from . import plugin
from .options import select_kernels


def prepare(model: ModelLike, kernels: str | None = None, portable: bool = False) -> ModelProto | LargeModel:
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

    A :class:`~onnx_training_ops.storage.LargeModel`, or a file past
    :func:`~onnx_training_ops.storage.large_model_bytes`, comes back as a LargeModel: the
    passes rewrite its message, its big tensors stay arrays (memory-mapped from the file).
    """
    if portable:
        passes = PORTABLE_PASSES
    else:
        passes = NATIVE_PASSES if select_kernels(kernels) == "native" else PASSES
    opened = load_model(model, large=True)
    result = proto_of(opened)
    for _, run_pass in passes:
        result = run_pass(result)
    if not portable:
        plugin.register()
    return opened.with_proto(result) if isinstance(opened, LargeModel) else result
