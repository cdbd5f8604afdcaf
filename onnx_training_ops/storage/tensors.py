"""Tensors in and out of the protobuf message: where a tensor's values are, their size, constant fills.

The convention is onnx's ``ModelContainer``'s: a tensor whose values left the message has
``data_location = EXTERNAL`` and a ``location``; ``#<key>`` names an array in the
container's ``large_initializers`` (:class:`.large_model.LargeModel`), any other location a
file beside the model (external data, :mod:`.external_data`). Functions here take any
``onnx.model_container.ModelContainer``.

:func:`large_model_bytes` is the size past which a model is handled as large (loaded
memory-mapped, built, prepared and saved with external data): 256 MiB, or the environment
variable ``ONNX_TRAINING_OPS_LARGE_MODEL_BYTES`` (tests lower it to take that path with
models of a few KB).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.model_container import ModelContainer

from ..errors import TrainingOpError
from ..walk import model_graphs

LARGE_MODEL_BYTES = 256 * 2**20
MIN_DETACHED_BYTES = 1024  # smaller tensors stay in the message (shapes, axes, scalars)
_ENV = "ONNX_TRAINING_OPS_LARGE_MODEL_BYTES"


def large_model_bytes() -> int:
    """Tensor bytes past which a model is large (``$ONNX_TRAINING_OPS_LARGE_MODEL_BYTES``
    or :data:`LARGE_MODEL_BYTES`)."""
    value = os.environ.get(_ENV)
    if not value:
        return LARGE_MODEL_BYTES
    try:
        return int(float(value))
    except ValueError:
        raise TrainingOpError(f"${_ENV} must be a number of bytes, found {value!r}") from None


def graphs_with_tensors(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The graphs whose big initializers may leave the message: the main graph and the
    training_info graphs (initialization, algorithm). Subgraphs (If/Loop bodies) keep theirs:
    onnxruntime takes external initializers for the main graph only."""
    graphs = [model.graph]
    for info in model.training_info:
        graphs += [info.initialization, info.algorithm]
    return graphs


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of ``model``: initializers and node attributes, every graph (subgraphs too)."""
    for graph in model_graphs(model):
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def location(tensor: onnx.TensorProto) -> str | None:
    """The ``location`` of an external tensor (None for one stored in the message)."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def constant_values(tensors) -> dict[str, np.ndarray]:
    """The values of the small tensors among ``tensors``, by name: those in the message
    that are integers (shapes, axes, sizes) or at most :data:`MIN_DETACHED_BYTES` (scalars).
    What passes read as constants, without converting every weight of a model."""
    integers = {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
                TensorProto.UINT64, TensorProto.UINT32, TensorProto.UINT16, TensorProto.UINT8, TensorProto.BOOL}
    return {t.name: numpy_helper.to_array(t) for t in tensors
            if location(t) is None and (t.data_type in integers or tensor_nbytes(t) <= MIN_DETACHED_BYTES)}


def set_location(tensor: onnx.TensorProto, where: str, offset: int | None = None,
                 length: int | None = None, checksum: str | None = None) -> None:
    """Make ``tensor`` external at ``where`` (its values in the message are dropped)."""
    for field in ("raw_data", "float_data", "double_data", "int32_data", "int64_data", "uint64_data",
                  "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", where), ("offset", offset), ("length", length), ("checksum", checksum)):
        if value is not None:
            tensor.external_data.add(key=key, value=str(value))


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of the tensor's values (from its type and dims: works for external tensors)."""
    try:
        if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
            raise KeyError(tensor.data_type)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except KeyError:  # strings, or a type onnx does not know: what the message holds
        return tensor.ByteSize()
    return int(np.prod(tensor.dims, dtype=np.int64)) * dtype.itemsize


class Deferred:
    """A detached tensor's values, read only when needed: a writer that takes one tensor at a
    time (:func:`~.save.save_model`) then holds one copy at a time (device state, streamed to
    disk). ``read()`` returns the array."""

    def __init__(self, read: Callable[[], np.ndarray]) -> None:
        self.read = read


def tensor_value(tensor: onnx.TensorProto, arrays: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """The values of ``tensor``: from the message, or ``arrays[location]`` for a detached one
    (a :class:`Deferred` one read now)."""
    where = location(tensor)
    if where is None:
        return numpy_helper.to_array(tensor)
    if arrays is None or where not in arrays:
        raise TrainingOpError(f"tensor {tensor.name!r}: its data is external ({where!r}) and no array "
                              "holds it; load the model from its file")
    value = arrays[where]
    return value.read() if isinstance(value, Deferred) else value


def constant_array(value, dtype, shape) -> np.ndarray:
    """A read-only array of ``shape`` filled with ``value`` that takes no memory (a
    broadcast view); a session materializes it (zeros: pages the OS gives on first write)."""
    return np.broadcast_to(np.asarray(value, dtype), tuple(shape))


def is_constant_fill(array: np.ndarray) -> bool:
    """True for a :func:`constant_array` (every stride 0): one value repeated."""
    return array.size > 1 and all(s == 0 for s in array.strides)


def proto_of(model: onnx.ModelProto | ModelContainer) -> onnx.ModelProto:
    """The message of a ModelProto or a ModelContainer (LargeModel)."""
    return model.model_proto if isinstance(model, ModelContainer) else model


def whole_proto(model: onnx.ModelProto | ModelContainer) -> onnx.ModelProto:
    """A message holding every tensor of ``model`` (a LargeModel's detached arrays put back in a
    copy): what one serialized string for onnxruntime needs; only for models under 2 GB."""
    return attach(model) if isinstance(model, ModelContainer) and model.large_initializers else proto_of(model)


def array_of(model: onnx.ModelProto | ModelContainer, tensor: onnx.TensorProto) -> np.ndarray:
    """The values of ``tensor`` of ``model``: its array if detached, else from the message."""
    return tensor_value(tensor, model.large_initializers if isinstance(model, ModelContainer) else None)


def add_array(model: ModelContainer, tensor: onnx.TensorProto, array: np.ndarray) -> None:
    """Detach ``tensor`` (of ``model``'s message): its values become ``array``, under a new key."""
    key, n = f"#{tensor.name}", 1
    while key in model.large_initializers:
        n += 1
        key = f"#{tensor.name}#{n}"
    set_location(tensor, key)
    model.large_initializers[key] = array


def attach(model: ModelContainer) -> onnx.ModelProto:
    """A ModelProto holding every tensor of ``model`` (for small models: a copy)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.model_proto)
    for tensor in all_tensors(proto):
        if location(tensor) is not None:
            name = tensor.name
            tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array_of(model, tensor)), name))
    return proto
