"""Checks a session runs before onnxruntime sees anything: a built loss's feeds, checkpoint properties.

A bad batch is one line naming the feed, not a kernel's error (a broadcast failure in a
gradient ``Sub``) or a silent step. For models made by
:func:`~onnx_training_ops.build_training_model` (metadata ``labels``, ``label_range``,
``label_shape``):

* an empty batch (labels/target or the first input with no rows) is refused for every loss:
  the mean loss of no example is undefined, and a zero-row MSE step still advanced T;
* the labels must have the shape the loss reads: the output's declared shape (without the
  class axis for cross-entropy), each dimension known either as a number or as a named
  dimension of a model input, read from that input's feed. Dimensions that are neither (a
  language model's logits flattened to ``[N*T, V]``) are not checked here: comparing labels
  with the first input instead refused valid GPT-2 exports;
* ``shift_labels`` needs a sequence length of at least 2 (one gave a NaN loss);
* class labels lie in ``[0, C)`` or equal ``ignore_index``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError

try:  # numba's loop; numpy's reduction without it
    from ...kernels._numba_labels import labels_in_range as _in_range
except ImportError:  # pragma: no cover - exercised only without numba
    _in_range = None

Check = Callable[[Mapping[str, Any]], None]
_UNSIGNED = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}


def _named_dims(inputs: Sequence[onnx.ValueInfoProto]) -> dict[str, tuple[str, int]]:
    """Each dim_param of the model inputs -> (first input declaring it, its axis)."""
    out: dict[str, tuple[str, int]] = {}
    for vi in inputs:
        if not vi.type.tensor_type.HasField("shape"):
            continue
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param:
                out.setdefault(dim.dim_param, (vi.name, axis))
    return out


def batch_checker(meta: TrainingMetadata, inputs: Sequence[onnx.ValueInfoProto], where: str = "step") -> Check | None:
    """The check of a built loss's feeds (None for models without a built loss)."""
    name = meta.labels or ""
    if not name:
        return None
    first = inputs[0].name if inputs else ""
    layout = meta.label_shape
    named = _named_dims(inputs)
    classes = ignore = None
    if meta.label_range is not None:
        classes, ignore = meta.label_range.classes, meta.label_range.ignore_index

    # feeds whose shapes decide the shape check: the labels, the first input, and the inputs
    # naming a dimension of the labels' expected shape
    deciding = [first] + sorted({named[d][0] for d in (layout or {}).get("shape", ()) if d in named})
    passed: set[tuple] = set()  # shape combinations checked before (a few per training run)

    def check(feeds: Mapping[str, Any]) -> None:
        labels = feeds.get(name)
        if labels is None:
            return  # the feed-name check reports it
        if type(labels) is not np.ndarray:
            labels = np.asarray(labels)
        key = (labels.shape, *(getattr(feeds.get(f), "shape", None) for f in deciding))
        if key not in passed:
            for feed, value in ((name, labels), (first, feeds.get(first))):
                if value is not None and np.size(value) == 0:
                    raise TrainingOpError(f"{where}: feed {feed!r} is empty: a batch needs at least one "
                                          "example (the mean loss of none is undefined)")
            if layout is not None:
                _check_shape(where, name, labels, layout, named, feeds)
            if len(passed) < 64 and None not in key[1:]:
                passed.add(key)
        if classes is not None and labels.dtype.kind in "iu":
            check_classes(where, name, labels, classes, ignore)

    return check


def _check_shape(where: str, name: str, labels: np.ndarray, layout: Mapping[str, Any], named, feeds) -> None:
    """``labels`` against the expected shape ``layout["shape"]`` (ints, dim names, None)."""
    expected = layout["shape"]
    output = layout["output"]
    if labels.ndim != len(expected):
        raise TrainingOpError(f"{where}: feed {name!r} has shape {list(labels.shape)}; the loss reads "
                              f"{output!r} of shape {layout['output_shape']}, so {name!r} must have rank "
                              f"{len(expected)} ({show_shape(expected)})")
    for axis, (want, got) in enumerate(zip(expected, labels.shape)):
        source = ""
        if isinstance(want, str):
            if want not in named:
                continue
            feed, feed_axis = named[want]
            value = feeds.get(feed)
            shape = np.shape(value) if value is not None else ()
            if len(shape) <= feed_axis:
                continue
            want = shape[feed_axis]
            source = (f"{got} rows, input {feed!r} has {want}" if axis == 0 and feed_axis == 0 else
                      f"{got} at axis {axis}, input {feed!r} has {want} at axis {feed_axis}")
        if want is None or want == got:
            continue
        detail = source or f"{got} at axis {axis} where the model declares {want}"
        raise TrainingOpError(f"{where}: feed {name!r} has {detail}: the loss reads {output!r} of shape "
                              f"{layout['output_shape']}, so {name!r} must have shape {show_shape(expected)}")
    if layout.get("shift") and labels.ndim >= 2 and labels.shape[1] < 2:
        raise TrainingOpError(f"{where}: feed {name!r} has sequence length {labels.shape[1]}: shift_labels "
                              "predicts token t+1 from tokens up to t, so it needs at least 2")


def label_mismatch(meta: TrainingMetadata, feeds: Mapping[str, Any], output_shape, where: str) -> str:
    """After onnxruntime failed: the one-line feed error if the labels do not fit the shape
    the loss's output has for this batch (``output_shape``, computed by the caller; dimensions
    the model does not name, such as the exporter's ``MatMullogits_dim_1``, are known only
    then), else ''."""
    layout = meta.label_shape
    labels = feeds.get(meta.labels or "")
    if layout is None or labels is None:
        return ""
    dims, axis = list(output_shape), layout.get("class_axis")
    expected = dims if axis is None else dims[:axis] + dims[axis + 1:]
    if list(np.shape(labels)) == expected:
        return ""
    return (f"{where}: feed {meta.labels!r} has shape {list(np.shape(labels))}; the loss reads "
            f"{layout['output']!r}, of shape {dims} for this batch, so {meta.labels!r} must have shape "
            f"{expected}")


def show_shape(shape) -> str:
    """``[2, ?, 'seq']``-style text of a declared shape."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def check_classes(where: str, name: str, labels: np.ndarray, classes: int, ignore: int | None) -> None:
    """Raise TrainingOpError unless every label is in ``[0, classes)`` or equals ``ignore``."""
    if _in_range is not None and labels.dtype.kind == "i" and labels.dtype.isnative and labels.flags.c_contiguous:
        if _in_range(labels.reshape(-1), classes, -1 if ignore is None else ignore, ignore is not None):
            return  # the common case: one loop
    elif labels.view(_UNSIGNED[labels.itemsize]).max() < classes:
        return  # one reduction: a negative label is a huge unsigned one
    bad = (labels < 0) | (labels >= classes)
    if ignore is not None:
        bad &= labels != ignore
    if bad.any():
        value = labels[bad].reshape(-1)[0]
        raise TrainingOpError(f"{where}: feed {name!r} holds class {value}, outside [0, {classes})"
                              + (f" and not ignore_index {ignore}" if ignore is not None else ""))


def checked_properties(properties: Mapping[str, Any]) -> str:
    """``properties`` as JSON, or a TrainingOpError naming the first value that is not a
    str, int, float or bool (what a checkpoint keeps, as onnxruntime-training's)."""
    if not isinstance(properties, Mapping):
        raise TrainingOpError(f"properties must be a dict, found {type(properties).__name__}")
    for key, value in properties.items():
        if not isinstance(key, str):
            raise TrainingOpError(f"properties: keys must be str, found {key!r}")
        if not isinstance(value, (str, int, float, bool)) or \
                (isinstance(value, float) and not np.isfinite(value)):
            raise TrainingOpError(f"properties[{key!r}] must be a str, int, bool or finite float, "
                                  f"found {value!r} ({type(value).__name__})")
    return json.dumps(dict(properties), sort_keys=True)


def stored_properties(text: str) -> dict[str, Any]:
    """The checkpoint's properties (metadata ``properties``), or a TrainingOpError saying they
    cannot be read."""
    try:
        properties = json.loads(text)
    except ValueError as error:
        raise TrainingOpError(f"the checkpoint's properties (metadata 'onnx_training_ops.properties') are not "
                              f"valid JSON: {error}") from None
    if not isinstance(properties, dict):
        raise TrainingOpError(f"the checkpoint's properties must be a JSON object, found {type(properties).__name__}")
    return properties
