"""The prepare pipeline: named passes that turn a valid training-domain graph into one onnxruntime runs.

``prepare(model)`` = the passes of :data:`PASSES` (PyOp kernels) or :data:`NATIVE_PASSES`
(native kernels, see :mod:`onnx_training_ops.native`), in order, on a copy of the model.
"""

from __future__ import annotations

import os
from typing import Callable, Union

from onnx import ModelProto

from ..errors import TrainingOpError

from .encode_exact_attributes import encode_exact_attributes
from .expand_gradient import expand_gradient
from .fill_defaults import fill_default_attributes
from .fit_runtime import fit_runtime
from .lower_cross_entropy import lower_cross_entropy
from .lower_optimizers import lower_optimizers
from .lower_recurrent import lower_recurrent
from .split_multi_tensor import split_multi_tensor_nodes
from .split_sequences import split_sequences
from .target_native import target_native
from .validate import validate
from ._graph import model_graphs

ModelLike = Union[ModelProto, str, os.PathLike, bytes]
Pass = Callable[[ModelProto], ModelProto]

PASSES: list[tuple[str, Pass]] = [
    ("validate", validate),
    ("split_sequences", split_sequences),
    ("lower_recurrent", lower_recurrent),
    ("expand_gradient", expand_gradient),
    ("lower_cross_entropy", lower_cross_entropy),
    ("fill_default_attributes", fill_default_attributes),
    ("split_multi_tensor_nodes", split_multi_tensor_nodes),
    ("encode_exact_attributes", encode_exact_attributes),
    ("fit_runtime", fit_runtime),
]
# What every kernel path shares: PASSES up to the PyOp-specific targeting.
_SHARED: list[tuple[str, Pass]] = [
    (name, run_pass) for name, run_pass in PASSES
    if name not in ("split_multi_tensor_nodes", "encode_exact_attributes", "fit_runtime")
]
# The native kernels take multi-tensor nodes whole and read the attributes themselves.
NATIVE_PASSES: list[tuple[str, Pass]] = _SHARED + [("target_native", target_native), ("fit_runtime", fit_runtime)]
# The portable form: every optimizer node lowered to standard ONNX ops (no plugin needed).
PORTABLE_PASSES: list[tuple[str, Pass]] = _SHARED + [("lower_optimizers", lower_optimizers),
                                                     ("fit_runtime", fit_runtime)]


def load_model(model: ModelLike) -> ModelProto:
    """A ModelProto from a ModelProto (copied), a path or serialized bytes."""
    if isinstance(model, ModelProto):
        copy = ModelProto()
        copy.CopyFrom(model)
        return copy
    if isinstance(model, (bytes, bytearray)):
        return _parsed(bytes(model), "the model bytes")
    if not isinstance(model, (str, os.PathLike)):
        raise TrainingOpError(f"expected an onnx.ModelProto, a path or bytes, found {type(model).__name__}")
    path = os.fspath(model)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise TrainingOpError(f"cannot read {path!r}: {error.strerror or error}") from None
    model = _parsed(data, repr(path))
    if data and len(data) > 0 and model.graph.ByteSize() == 0 and not model.training_info:
        raise TrainingOpError(f"{path!r} holds no ONNX model (no graph)")
    _load_external_data(model, os.path.dirname(os.path.abspath(path)))
    return model


def _load_external_data(model: ModelProto, base_dir: str) -> None:
    """Read the tensors stored beside the model file (``onnx.save(..., save_as_external_data=True)``)
    into the model, in every graph (training_info included, which onnx's own loader skips)."""
    from onnx import AttributeProto
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    for graph in model_graphs(model):
        tensors = list(graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    tensors.append(attr.t)
                elif attr.type == AttributeProto.TENSORS:
                    tensors.extend(attr.tensors)
        for tensor in tensors:
            if uses_external_data(tensor):
                try:
                    load_external_data_for_tensor(tensor, base_dir)
                except Exception as error:  # noqa: BLE001 - onnx's ValidationError, OSError...
                    raise TrainingOpError(f"tensor {tensor.name!r}: cannot read its external data "
                                          f"(relative to {base_dir!r}): {error}") from None


def _parsed(data: bytes, where: str) -> ModelProto:
    if not data:
        raise TrainingOpError(f"{where} is empty (0 bytes): not an ONNX model")
    model = ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as error:  # noqa: BLE001  protobuf's DecodeError and friends
        raise TrainingOpError(f"{where} is not an ONNX model (protobuf could not parse it: "
                              f"{error})") from None
    return model


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
        from ..native import select_kernels

        passes = NATIVE_PASSES if select_kernels(kernels) == "native" else PASSES
    result = load_model(model)
    for _, run_pass in passes:
        result = run_pass(result)
    if not portable:
        from ..plugin import register

        register()
    return result
