"""Model files: read a model from a ModelProto, a LargeModel, a path or bytes, external data included.

:func:`load_model` gives a ModelProto holding every tensor (what most code wants for small
models). With ``large=True`` a model past :func:`.large_model.large_model_bytes` comes back
as a :class:`.large_model.LargeModel` instead, its big tensors memory-mapped from the files
(external data, or the ``.onnx`` itself when they are stored inline): nothing is read until
used, and nothing is serialized. The message is parsed from a memory map of the file (no
second copy of the file in the process), and a message whose tensors left it is copied into
a fresh one: protobuf frees a message's memory only when no part of it is referenced.

:func:`as_model` is what every public entry calls on the model it is given: the one model
type of the inner layers (:class:`.large_model.LargeModel`), whatever its size.
"""

from __future__ import annotations

import json
import mmap
import os

import onnx
from onnx import ModelProto
from onnx.model_container import ModelContainer

from ..errors import TrainingOpError
from .external_data import map_external, map_inline, span
from .large_model import LargeModel, detach
from .tensors import all_tensors, attach, large_model_bytes, location, tensor_nbytes

ModelLike = ModelProto | ModelContainer | str | os.PathLike | bytes


def load_model(model: ModelLike, large: bool = False) -> ModelProto | LargeModel:
    """A ModelProto (a copy) from a ModelProto, LargeModel, path or serialized bytes.

    ``large=True``: a LargeModel given stays one (a copy of its message over the same
    arrays) and a file past :func:`.large_model.large_model_bytes` of tensors is opened as
    one, its big tensors memory-mapped; otherwise every tensor is read into the message.
    """
    if isinstance(model, ModelProto):
        copy = ModelProto()
        copy.CopyFrom(model)
        if large and model.ByteSize() > large_model_bytes():
            return compact(detach(copy))
        return copy
    if isinstance(model, ModelContainer):
        opened = model.copy() if isinstance(model, LargeModel) else _container(model)
        return opened if large else attach(opened)
    if isinstance(model, (bytes, bytearray)):
        return _parsed(bytes(model), "the model bytes")
    if not isinstance(model, (str, os.PathLike)):
        raise TrainingOpError(f"expected an onnx.ModelProto, a LargeModel, a path or bytes, found "
                              f"{type(model).__name__}")
    path = model_file(os.fspath(model))
    before = _stat(path)
    try:
        return _load_file(path, large)
    except TrainingOpError:
        # a writer may have replaced the message and removed the data file of the version
        # just read (storage.save): a changed file is read again, once
        if _stat(path) == before:
            raise
        return _load_file(path, large)


def as_model(model: ModelLike, copy: bool = True) -> LargeModel:
    """``model`` as the package's one model type, whatever its size.

    A small model comes back as a LargeModel with ``large=False`` and every tensor in its
    message; a large one (a ModelContainer given, or past
    :func:`.tensors.large_model_bytes`) as :func:`load_model` with ``large=True`` opens it:
    its big tensors arrays, memory-mapped from a file.

    Args:
        model: a ModelProto, LargeModel (or onnx ModelContainer), path (a model file, or a
            folder: :func:`model_file`) or serialized bytes.
        copy: False shares what it can with ``model`` (a LargeModel given is returned as it
            is, a small ModelProto's message is not copied): for a caller that changes
            nothing, or that copies what it changes.

    Returns:
        The LargeModel.

    Raises:
        TrainingOpError: the model cannot be read (naming the file and what is wrong).
    """
    if not copy:
        if isinstance(model, LargeModel):
            return model
        if isinstance(model, ModelProto) and model.ByteSize() <= large_model_bytes():
            return LargeModel(model, large=False)
    opened = load_model(model, large=True)
    return opened if isinstance(opened, LargeModel) else LargeModel(opened, large=False)


GENAI_CONFIG = "genai_config.json"  # what onnxruntime-genai's model builder writes beside the model


def model_file(path: str) -> str:
    """The model file a path names: ``path`` itself, or for a folder the decoder model that
    its ``genai_config.json`` names (onnxruntime-genai's model builder output), else the
    folder's only ``.onnx`` file.

    Raises:
        TrainingOpError: a folder with neither, or with several ``.onnx`` files and no config.
    """
    if not os.path.isdir(path):
        return path
    config = os.path.join(path, GENAI_CONFIG)
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                filename = json.load(f)["model"]["decoder"]["filename"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise TrainingOpError(f"{config!r}: cannot read model.decoder.filename ({error!r})") from None
        return os.path.join(path, filename)
    found = sorted(name for name in os.listdir(path) if name.endswith(".onnx"))
    if len(found) != 1:
        raise TrainingOpError(f"folder {path!r} has {'no' if not found else len(found)} .onnx files"
                              f"{': ' + ', '.join(found) if found else ''} and no {GENAI_CONFIG}: "
                              "pass the model file")
    return os.path.join(path, found[0])


def _stat(path: str):
    try:
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns, st.st_size
    except OSError:
        return None


def _container(model: ModelContainer) -> LargeModel:
    proto = ModelProto()
    proto.CopyFrom(model.model_proto)
    return LargeModel(proto, model.large_initializers)


def _load_file(path: str, large: bool) -> ModelProto | LargeModel:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise TrainingOpError(f"{path!r} is empty (0 bytes): not an ONNX model")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(buf)  # parsed in place: no bytes copy of the file
            try:
                model = _parsed(view, repr(path))
            finally:
                try:
                    view.release()
                    buf.close()
                except BufferError:  # a failed parse may hold the buffer a while: the map closes when freed
                    pass
    except OSError as error:
        raise TrainingOpError(f"cannot read {path!r}: {error.strerror or error}") from None
    if not _has_graph(model.graph) and not model.training_info:
        raise TrainingOpError(f"{path!r} holds no ONNX model (no graph)")
    base_dir = os.path.dirname(os.path.abspath(path))
    external = [t for t in all_tensors(model) if location(t) is not None]
    for tensor in external:
        span(tensor, base_dir)  # a missing or short file is named now
    if not large or sum(tensor_nbytes(t) for t in all_tensors(model)) <= large_model_bytes():
        _read_external(external, base_dir)
        return model
    opened = map_external(LargeModel(model), base_dir)
    _read_external([t for t in all_tensors(model) if location(t) not in (None, *opened.large_initializers)],
                   base_dir)  # tensors in node attributes: small, read into the message
    if size > large_model_bytes():
        map_inline(opened, path)
    del model, external
    return compact(opened)


def compact(model: LargeModel) -> LargeModel:
    """``model`` over a fresh copy of its message: protobuf frees a message's memory (the
    values of tensors that left it included) only when no part of it is referenced, so the
    caller drops the old message and keeps this one."""
    skeleton = ModelProto()
    skeleton.CopyFrom(model.model_proto)
    return LargeModel(skeleton, model.large_initializers, model.large)


def _has_graph(graph: onnx.GraphProto) -> bool:
    return bool(graph.node or graph.initializer or graph.input or graph.output)


def _read_external(tensors: list[onnx.TensorProto], base_dir: str) -> None:
    """Read the values of ``tensors`` (stored beside the model file) into the message."""
    from onnx.external_data_helper import load_external_data_for_tensor

    for tensor in tensors:
        try:
            load_external_data_for_tensor(tensor, base_dir)
        except Exception as error:  # noqa: BLE001 - onnx's ValidationError, OSError...
            raise TrainingOpError(f"tensor {tensor.name!r}: cannot read its external data "
                                  f"(relative to {base_dir!r}): {error}") from None


def _parsed(data, where: str) -> ModelProto:
    if not len(data):
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
