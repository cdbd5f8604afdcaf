"""Tensor values in files beside the model (onnx's external data), read and written in place.

**Reading.** :func:`map_external` turns every tensor of a message whose values lie in a
file (``location`` relative to the model's directory, ``offset``, ``length``) into a
read-only ``np.memmap`` of that span: nothing is read until used, and pages read stay in
the page cache, shared, not copied. :func:`map_inline` does the same for the big tensors
of a model stored inline, from their offsets in the ``.onnx`` file itself
(:mod:`.inline_offsets`). :func:`read_into` copies a span into an array the caller owns,
by ``readinto`` (not through a mapping: the pages are not mapped into the process, so the
copy is the only one its resident set counts), hashing it on the way.

**Writing.** :func:`write_tensors` streams arrays into one open file, each at an offset
aligned to :data:`ALIGNMENT` (a page: the reader maps each tensor aligned), hashing each
(SHA-256 of its little-endian bytes) as it goes; a zero-filled constant array
(:func:`.large_model.constant_array`) is written as a hole (a sparse file, no disk blocks).
Nothing is ever serialized into one bytes object.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
from collections.abc import Iterable
from typing import Any, BinaryIO, TypeVar

import numpy as np
import onnx
from onnx import helper
from onnx.model_container import ModelContainer

from ..errors import TrainingOpError
from .inline_offsets import raw_data_offsets
from .tensors import MIN_DETACHED_BYTES, add_array, graphs_with_tensors, is_constant_fill, location, tensor_nbytes

ALIGNMENT = 4096
CHUNK = 64 * 2**20  # bytes per write/hash of a tensor that is not one contiguous buffer
_Container = TypeVar("_Container", bound=ModelContainer)  # a LargeModel stays one


def _entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _checked_path(base_dir: str, where: str, tensor: onnx.TensorProto) -> str:
    """``base_dir/where``; a location that is absolute or leaves ``base_dir``, in its text or
    through a symlink, is refused (onnx's rule: a model must not read files outside its
    directory), and so is a symlink (onnx's loader refuses one even inside)."""
    if not where or os.path.isabs(where) or os.path.normpath(where).split(os.sep)[0] == "..":
        raise TrainingOpError(f"tensor {tensor.name!r}: external data location {where!r} must be a relative "
                              "path inside the model's directory")
    path = os.path.join(base_dir, where)
    root, real = os.path.realpath(base_dir or "."), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise TrainingOpError(f"tensor {tensor.name!r}: external data location {where!r} resolves to {real!r}, "
                              "outside the model's directory (a symlink out of it is refused, as onnx's loader does)")
    if os.path.islink(path):
        raise TrainingOpError(f"tensor {tensor.name!r}: external data location {where!r} is a symbolic link; "
                              "onnx's loader refuses those: copy the file into the model's directory")
    return path


def _dtype(tensor: onnx.TensorProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")


def span(tensor: onnx.TensorProto, base_dir: str) -> tuple[str, int, int]:
    """(file, offset, length) of an external tensor's values, checked against the file's size."""
    entries = _entries(tensor)
    path = _checked_path(base_dir, entries.get("location", ""), tensor)
    try:
        offset = int(entries.get("offset", 0))
        size = os.path.getsize(path)
        length = int(entries["length"]) if "length" in entries else size - offset
    except OSError as error:
        raise TrainingOpError(f"tensor {tensor.name!r}: cannot read its external data {path!r}: "
                              f"{error.strerror or error}") from None
    except ValueError:
        raise TrainingOpError(f"tensor {tensor.name!r}: external data offset/length are not integers: "
                              f"{entries}") from None
    if length != tensor_nbytes(tensor):
        raise TrainingOpError(f"tensor {tensor.name!r}: external data holds {length} bytes, its type and shape "
                              f"{list(tensor.dims)} need {tensor_nbytes(tensor)}")
    if offset < 0 or offset + length > size:
        raise TrainingOpError(f"tensor {tensor.name!r}: external data [{offset}, {offset + length}) lies past the "
                              f"end of {path!r} ({size} bytes): the file is truncated")
    return path, offset, length


def _memmap(path: str, offset: int, tensor: onnx.TensorProto) -> np.ndarray:
    dtype = _dtype(tensor)
    shape = tuple(tensor.dims)
    if tensor_nbytes(tensor) == 0:
        return np.zeros(shape, dtype)
    array = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
    return array if sys.byteorder == "little" else np.asarray(array).byteswap().view(dtype.newbyteorder("="))


def map_external(model: _Container, base_dir: str) -> _Container:
    """Every file-external tensor of ``model`` (in place) as a read-only memory map."""
    for graph in graphs_with_tensors(model.model_proto):
        for tensor in graph.initializer:
            where = location(tensor)
            if where is None or where.startswith("#"):
                continue
            path, offset, _ = span(tensor, base_dir)
            add_array(model, tensor, _memmap(path, offset, tensor))
    return model


def map_inline(model: _Container, path: str, min_bytes: int = MIN_DETACHED_BYTES) -> _Container:
    """The initializers of ``min_bytes`` or more that ``model`` (parsed from ``path``) holds
    inline, detached as read-only memory maps of their bytes in ``path`` (in place)."""
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            offsets = raw_data_offsets(buf)
    proto = model.model_proto
    graphs = {"graph": proto.graph}
    for i, info in enumerate(proto.training_info):
        graphs[f"training_info[{i}].initialization"] = info.initialization
        graphs[f"training_info[{i}].algorithm"] = info.algorithm
    for key, graph in graphs.items():
        found = offsets.get(key, [])
        if len(found) != len(graph.initializer):
            continue  # the file and the message disagree (never for a file we just parsed): keep values
        for tensor, raw in zip(graph.initializer, found):
            if raw is None or raw.name != tensor.name or location(tensor) is not None \
                    or raw.length != tensor_nbytes(tensor) or raw.length < min_bytes:
                continue
            add_array(model, tensor, _memmap(path, raw.offset, tensor))
    return model


def _chunks(array: np.ndarray) -> Iterable[memoryview]:
    """The little-endian bytes of ``array``, as buffers of at most :data:`CHUNK` bytes."""
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.ndim == 0 or array.flags.c_contiguous:
        flat = np.ascontiguousarray(array).reshape(-1).data.cast("B")
        for start in range(0, len(flat), CHUNK):
            yield flat[start:start + CHUNK]
        return
    rows = max(1, CHUNK // max(1, array[:1].nbytes))  # whole rows of axis 0, made contiguous a block at a time
    for start in range(0, array.shape[0], rows):
        yield np.ascontiguousarray(array[start:start + rows]).reshape(-1).data.cast("B")


def digest(array: np.ndarray) -> str:
    """SHA-256 of ``array``'s little-endian bytes, streamed (no copy of a contiguous array)."""
    h = hashlib.sha256()
    for chunk in _chunks(array):
        h.update(chunk)
    return h.hexdigest()


def write_tensors(f: BinaryIO, arrays: Iterable[tuple[Any, np.ndarray]]) -> dict[Any, tuple[int, int, str]]:
    """Append each (key, array) to ``f`` at an aligned offset, in order (``arrays`` may be
    a generator: one array alive at a time); ``{key: (offset, length, sha256)}``. A
    zero-filled constant array becomes a hole in the file."""
    out = {}
    pos = f.tell()
    for name, array in arrays:
        pos = -(-pos // ALIGNMENT) * ALIGNMENT
        f.seek(pos)
        length = array.size * array.itemsize
        h = hashlib.sha256()
        if is_constant_fill(array) and not np.asarray(array).reshape(-1)[:1].any():
            zeros = bytes(min(length, CHUNK))
            for start in range(0, length, CHUNK):
                h.update(zeros[:min(CHUNK, length - start)])
            f.seek(pos + length)
        else:
            for chunk in _chunks(array):
                h.update(chunk)
                f.write(chunk)
        out[name] = (pos, length, h.hexdigest())
        pos += length
    f.truncate(pos)  # a trailing hole still counts in the file's size
    return out


def read_into(path: str, offset: int, out: np.ndarray, hasher=None) -> np.ndarray:
    """Fill the C-contiguous array ``out`` from ``path`` at ``offset`` (``readinto``, no
    mapping), updating ``hasher`` with the bytes on the way; returns ``out``."""
    view = out.reshape(-1).data.cast("B") if out.size else memoryview(b"")
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + CHUNK])
            if not n:
                raise TrainingOpError(f"{path!r} ends {len(view) - done} bytes early (offset {offset})")
            if hasher is not None:
                hasher.update(view[done:done + n])
            done += n
    if sys.byteorder == "big":  # pragma: no cover - the files are little-endian
        out.byteswap(inplace=True)
    return out


def transposed(array: np.ndarray, perm) -> np.ndarray:
    """``array.transpose(perm)`` as a new C-contiguous array. A 2-D memory map is read in
    blocks of rows by ``readinto`` (its pages are never mapped into the process), so the
    result is the only copy the resident set counts."""
    perm = tuple(perm)
    if not (isinstance(array, np.memmap) and array.filename is not None and array.ndim == 2 and perm == (1, 0)):
        return np.ascontiguousarray(np.asarray(array).transpose(perm))
    rows, cols = array.shape
    out = np.empty((cols, rows), array.dtype)
    step = max(1, CHUNK // max(1, cols * array.itemsize))
    block = np.empty((step, cols), array.dtype)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        read_into(array.filename, array.offset + start * cols * array.itemsize, block[:n])
        out[:, start:start + n] = block[:n].T
    return out
