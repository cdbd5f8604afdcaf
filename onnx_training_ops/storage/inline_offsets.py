"""Where each initializer's ``raw_data`` lies inside an ``.onnx`` file, read from protobuf's wire format.

A model stored inline (no external data) holds every tensor's bytes in the file. Parsing it
with protobuf copies them all into the message; knowing their offsets lets the loader map
the big ones from the file instead (``np.memmap``), so the tensors exist once, in the page
cache, until someone writes them. Only the fields leading to initializers are followed:
``ModelProto.graph`` (7) and ``training_info`` (20: ``initialization`` 1, ``algorithm`` 2),
``GraphProto.initializer`` (5), ``TensorProto.name`` (8) and ``raw_data`` (9); everything
else is skipped by its length. Subgraphs (If/Loop bodies) are not followed: their tensors
stay in the message.
"""

from __future__ import annotations

from typing import NamedTuple

_MODEL_GRAPH, _MODEL_TRAINING_INFO = 7, 20
_INFO_INITIALIZATION, _INFO_ALGORITHM = 1, 2
_GRAPH_INITIALIZER = 5
_TENSOR_NAME, _TENSOR_RAW_DATA = 8, 9


class RawData(NamedTuple):
    """One initializer's ``raw_data``: its tensor name, byte offset in the file and length."""

    name: str
    offset: int
    length: int


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def _fields(buf, start: int, end: int):
    """(field number, wire type, value start, value end) of each field in ``buf[start:end]``;
    a varint's or fixed value's span is its encoded bytes."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _varint(buf, pos)
        elif wire == 1:
            after = pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            after = pos + length
        elif wire == 5:
            after = pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire} at byte {pos}")
        if after > end:
            raise ValueError(f"field {number} runs past its message (byte {after} > {end})")
        yield number, wire, pos, after
        pos = after


def _tensor(buf, start: int, end: int) -> RawData | None:
    name, raw = "", None
    for number, wire, a, b in _fields(buf, start, end):
        if wire != 2:
            continue
        if number == _TENSOR_NAME:
            name = bytes(buf[a:b]).decode("utf-8")
        elif number == _TENSOR_RAW_DATA:
            raw = (a, b - a)
    return None if raw is None else RawData(name, raw[0], raw[1])


def _graph(buf, start: int, end: int) -> list[RawData | None]:
    return [_tensor(buf, a, b) for number, wire, a, b in _fields(buf, start, end)
            if number == _GRAPH_INITIALIZER and wire == 2]


def raw_data_offsets(buf) -> dict[str, list[RawData | None]]:
    """For each graph holding initializers: ``"graph"``, ``"training_info[i].initialization"``,
    ``"training_info[i].algorithm"`` -> one entry per initializer in file order (``None``
    for a tensor whose values are not in ``raw_data``). ``buf``: the file's bytes (an
    ``mmap`` is enough: nothing is copied but names)."""
    out: dict[str, list] = {}
    info_index = 0
    for number, wire, a, b in _fields(buf, 0, len(buf)):
        if wire != 2:
            continue
        if number == _MODEL_GRAPH:
            out.setdefault("graph", []).extend(_graph(buf, a, b))  # a repeated message field merges
        elif number == _MODEL_TRAINING_INFO:
            for sub, sub_wire, c, d in _fields(buf, a, b):
                if sub_wire == 2 and sub in (_INFO_INITIALIZATION, _INFO_ALGORITHM):
                    kind = "initialization" if sub == _INFO_INITIALIZATION else "algorithm"
                    out.setdefault(f"training_info[{info_index}].{kind}", []).extend(_graph(buf, c, d))
            info_index += 1
    return out
