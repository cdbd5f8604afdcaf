"""Model files: read a ModelProto from a ModelProto, a path or bytes, external data included."""

from __future__ import annotations

import os
from typing import Union

from onnx import ModelProto

from ..errors import TrainingOpError
from ..walk import model_graphs

ModelLike = Union[ModelProto, str, os.PathLike, bytes]


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
        cut = truncation(data)
        if cut:
            raise TrainingOpError(f"{where} is truncated: {cut}, so the file was cut short (a copy or "
                                  "write that did not finish); restore it from a complete copy") from None
        raise TrainingOpError(f"{where} is not an ONNX model (protobuf could not parse it: "
                              f"{error})") from None
    return model


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None, pos


def truncation(data: bytes) -> str:
    """How ``data`` ends too early, if it is a protobuf message cut short: its top-level fields
    read well until one runs past the end ('' when the bytes are not such a prefix)."""
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos)
        if tag is None:
            return f"its {len(data)} bytes end inside a field's tag"
        field, wire = tag >> 3, tag & 7
        if field == 0 or wire not in (0, 1, 2, 5):
            return ""  # not a protobuf message at all
        if wire == 0:
            value, pos = _varint(data, pos)
            if value is None:
                return f"its {len(data)} bytes end inside field {field}"
            continue
        if wire == 2:
            size, pos = _varint(data, pos)
            if size is None:
                return f"its {len(data)} bytes end inside field {field}'s length"
        else:
            size = 8 if wire == 1 else 4
        if pos + size > len(data):
            return (f"field {field} of the model needs {size} bytes from offset {pos}, the file has "
                    f"{len(data)} bytes in all")
        pos += size
    return ""
