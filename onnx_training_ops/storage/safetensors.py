"""The safetensors format, read and written here (no dependency): the exported state's file.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON, then the
tensors' raw little-endian bytes back to back. The header maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows the
header) and may hold ``"__metadata__"``, a map of strings. The format's definition:
the ``safetensors`` project's README ("Format").

The layout written here is a function of the tensors alone, so two writers (this module and
the JavaScript trainer's ``js/src/safetensors.js``) produce the same bytes for the same
state: tensors ordered by element size (largest first: every tensor stays aligned to its
element size) then name, compact JSON in that order, the header padded with spaces to a
multiple of 8 bytes. The exported inference model reads its weights from
``state.safetensors`` by offset (ONNX external data), so a state file written by the
trainer after training lines up with it.

Our writers put the lowercase hex SHA-256 of the data section (the bytes after the header)
in ``__metadata__["sha256"]`` (:func:`encode`, after the other metadata); :func:`decode`
checks it when present (``verify=False`` skips it), so a flipped byte in a tensor is caught.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping

import numpy as np

from ..errors import TrainingOpError

# safetensors dtype code <-> numpy dtype (little-endian)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
MAX_HEADER = 100_000_000  # the reference implementation's limit
DIGEST = "sha256"  # __metadata__ key: SHA-256 of the data section


def dtype_code(dtype: np.dtype, name: str) -> str:
    """The safetensors code of ``dtype`` (``F32``...), or a TrainingOpError naming ``name``."""
    code = CODES.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise TrainingOpError(f"tensor {name!r}: dtype {np.dtype(dtype).name} has no safetensors code "
                              f"(supported: {', '.join(d.name for d in DTYPES.values())})")
    return code


def layout(tensors: Mapping[str, np.ndarray]) -> list[str]:
    """The order tensors are stored in: element size descending, then name."""
    return sorted(tensors, key=lambda name: (-np.dtype(tensors[name].dtype).itemsize, name))


def header(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and padded JSON header of a file holding ``tensors``."""
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in layout(tensors):
        array = tensors[name]
        size = int(array.size) * array.dtype.itemsize
        entries[name] = {"dtype": dtype_code(array.dtype, name), "shape": list(array.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """``tensors`` (name -> array) as safetensors bytes.

    Args:
        tensors: name -> array.
        metadata: ``__metadata__`` entries; ``"sha256"`` (the data section's digest) is added last.

    Returns:
        The file's bytes.
    """
    arrays = {name: np.asarray(value) for name, value in tensors.items()}
    parts = []
    for name in layout(arrays):
        array = arrays[name]
        dtype_code(array.dtype, name)
        parts.append(np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())
    body = b"".join(parts)
    digest = hashlib.sha256(body).hexdigest()
    meta = {**{k: v for k, v in (metadata or {}).items() if k != DIGEST}, DIGEST: digest}
    return header(arrays, meta) + body


def parse_header(data: bytes | memoryview, where: str) -> tuple[dict, int]:
    """(the JSON header, the offset where tensor data starts), checked."""
    if len(data) < 8:
        raise TrainingOpError(f"{where}: not a safetensors file ({len(data)} bytes, the header length "
                              "alone takes 8)")
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    if length > MAX_HEADER or 8 + length > len(data):
        raise TrainingOpError(f"{where}: not a safetensors file (header length {length}, file "
                              f"{len(data)} bytes)")
    try:
        table = json.loads(bytes(data[8:8 + length]).decode())
    except (UnicodeDecodeError, ValueError) as error:
        raise TrainingOpError(f"{where}: the safetensors header is not JSON: {error}") from None
    if not isinstance(table, dict):
        raise TrainingOpError(f"{where}: the safetensors header is not a JSON object")
    return table, 8 + length


def decode(data: bytes | memoryview, where: str = "safetensors data",
           verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of safetensors bytes; each tensor a fresh writeable array.

    Args:
        data: the file's bytes.
        where: how messages name the file.
        verify: check ``__metadata__["sha256"]`` against the data section when present.

    Returns:
        (name -> array, metadata).

    Raises:
        TrainingOpError: a malformed header, metadata that is not an object of strings,
            overlapping or misplaced tensors, or a digest that differs.
    """
    table, start = parse_header(data, where)
    metadata = table.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TrainingOpError(f"{where}: the safetensors header's '__metadata__' must be an object of strings, "
                              f"found {json.dumps(metadata)[:80]}")
    body = len(data) - start
    tensors: dict[str, np.ndarray] = {}
    spans = []
    for name, entry in table.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise TrainingOpError(f"{where}: tensor {name!r}: a malformed header entry {entry!r} (expected "
                                  f"dtype in {sorted(DTYPES)}, shape, data_offsets)") from None
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= body or end - begin != size:
            raise TrainingOpError(f"{where}: tensor {name!r}: {entry['dtype']} {list(shape)} needs {size} "
                                  f"bytes, data_offsets {[begin, end]} (data holds {body} bytes)")
        spans.append((begin, end, name))
        raw = np.frombuffer(data, dtype, count=size // dtype.itemsize, offset=start + begin)
        tensors[name] = raw.astype(dtype.newbyteorder("="), copy=True).reshape(shape)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise TrainingOpError(f"{where}: tensor {name!r} starts at byte {begin} of the data, expected "
                                  f"{position}: tensors must not overlap or leave gaps")
        position = end
    if position != body:
        raise TrainingOpError(f"{where}: {body - position} bytes after the last tensor")
    if verify and DIGEST in metadata and hashlib.sha256(memoryview(data)[start:]).hexdigest() != metadata[DIGEST]:
        raise TrainingOpError(f"{where}: the tensor data's SHA-256 differs from the header's "
                              f"'__metadata__.{DIGEST}': the file is damaged")
    return tensors, dict(metadata)


def read(path: str | os.PathLike, verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file (:func:`decode`; ``verify``: check its digest)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise TrainingOpError(f"cannot read {os.fspath(path)!r}: {error.strerror or error}") from None
    return decode(data, repr(os.fspath(path)), verify)


def offsets(data: bytes | memoryview) -> dict[str, tuple[int, int]]:
    """Each tensor's (file offset, length) in safetensors bytes: what ONNX external data needs."""
    table, start = parse_header(data, "safetensors data")
    table.pop("__metadata__", None)
    return {name: (start + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0])
            for name, e in table.items()}
