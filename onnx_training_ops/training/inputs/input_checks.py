"""Checks of the model's own inputs before onnxruntime runs: one line naming the feed.

Without them a bad batch surfaces as a kernel's error deep in the graph: an
``attention_mask`` one token shorter than ``input_ids`` fails in an exporter-named
broadcast (``node_add_14``), a token id past the vocabulary in a ``Gather``. Two checks,
where the model says enough:

* **shared dimensions**: inputs that declare the same named dimension (``batch``,
  ``sequence``) must be fed arrays that agree on it;
* **lookup tables**: an integer input that indexes the rows of an initializer (``Gather``
  on axis 0, directly or through shape-only ops such as ``Reshape``/``Unsqueeze``/``Cast``:
  an embedding table) must hold ids within the table's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from ...errors import TrainingOpError

Check = Callable[[Mapping[str, Any]], None]
# ops that carry index values through unchanged (only their layout or type changes)
_VALUE_PRESERVING = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Identity", "Expand", "Transpose"}
_INT_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
              onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}


def _shared_dims(inputs) -> dict[str, list[tuple[str, int]]]:
    """dim_param -> [(input, axis)] for names that two or more axes declare."""
    seen: dict[str, list[tuple[str, int]]] = {}
    for vi in inputs:
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        for axis, dim in enumerate(tt.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param:
                seen.setdefault(dim.dim_param, []).append((vi.name, axis))
    return {name: axes for name, axes in seen.items() if len(axes) > 1}


def _lookups(graph: onnx.GraphProto, inputs) -> dict[str, tuple[str, int, str]]:
    """Integer input -> (table initializer, its rows, Gather node) for the first table it indexes."""
    tables = {t.name: t for t in graph.initializer if len(t.dims) >= 1}
    origin = {vi.name: vi.name for vi in inputs if vi.type.tensor_type.elem_type in _INT_TYPES}
    found: dict[str, tuple[str, int, str]] = {}
    for node in graph.node:  # graph order is topological: an origin is known before it is read
        if node.domain not in ("", "ai.onnx") or not node.input:
            continue
        if node.op_type in _VALUE_PRESERVING and node.input[0] in origin:
            for out in node.output[:1]:
                origin[out] = origin[node.input[0]]
        elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in origin \
                and node.input[0] in tables:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if axis == 0:
                found.setdefault(origin[node.input[1]], (node.input[0], int(tables[node.input[0]].dims[0]),
                                                         node.name or node.output[0]))
    return found


def input_checker(graph: onnx.GraphProto, initializers: set[str], where: str) -> Check | None:
    """The check of the model inputs' feeds for ``where`` (None when the model says nothing checkable)."""
    inputs = [vi for vi in graph.input if vi.name not in initializers]
    shared = _shared_dims(inputs)
    lookups = _lookups(graph, inputs)
    if not shared and not lookups:
        return None
    passed: set[tuple] = set()
    shape_feeds = sorted({name for axes in shared.values() for name, _ in axes})

    def check(feeds: Mapping[str, Any]) -> None:
        key = tuple(getattr(feeds.get(f), "shape", None) for f in shape_feeds)
        if shared and key not in passed:
            _check_shared(where, shared, feeds)
            if len(passed) < 64:
                passed.add(key)
        for name, (table, rows, node) in lookups.items():
            value = feeds.get(name)
            if value is None:
                continue
            ids = value if type(value) is np.ndarray else np.asarray(value)
            if ids.size == 0 or ids.dtype.kind not in "iu":
                continue
            low, high = int(ids.min()), int(ids.max())
            if high >= rows or low < -rows:
                bad = high if high >= rows else low
                at = tuple(int(i) for i in np.argwhere(ids == bad)[0])
                raise TrainingOpError(
                    f"{where}: feed {name!r} holds {bad} at {list(at)}, but it indexes the {rows} rows of "
                    f"{table!r} (Gather node {node!r}): ids must lie in [0, {rows}) (a vocabulary of {rows}; "
                    "was the data tokenized for another model?)")

    return check


def _check_shared(where: str, shared, feeds: Mapping[str, Any]) -> None:
    for dim, axes in shared.items():
        known = [(name, axis, np.shape(feeds[name])) for name, axis in axes if feeds.get(name) is not None]
        known = [(name, axis, shape[axis]) for name, axis, shape in known if len(shape) > axis]
        for name, axis, size in known[1:]:
            first, first_axis, first_size = known[0]
            if size != first_size:
                raise TrainingOpError(
                    f"{where}: feed {name!r} has {size} at axis {axis} but feed {first!r} has {first_size} at "
                    f"axis {first_axis}: the model declares both as dimension {dim!r}, so they must be equal "
                    f"(e.g. an attention_mask as long as the input_ids)")
