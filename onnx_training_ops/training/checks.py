"""Checks a session runs before onnxruntime sees anything: class labels, checkpoint properties."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import TrainingOpError


def label_checker(meta: Mapping[str, str], batch_input: str | None) -> Callable[[Mapping[str, Any]], None] | None:
    """For the builder's cross-entropy: a check that class labels lie in [0, C) (or equal
    ignore_index) and come in as many rows as the model's first input, so a bad label is our
    error naming the feed, not a kernel's."""
    spec = meta.get("label_range", "")
    name = meta.get("labels", "")
    if not spec or not name:
        return None
    classes_text, ignore_text = spec.split(",")
    classes, ignore = int(classes_text), (int(ignore_text) if ignore_text else None)
    unsigned = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}

    def check(feeds: Mapping[str, Any]) -> None:
        labels = feeds.get(name)
        if type(labels) is not np.ndarray:
            labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            return  # the feed check names a wrong dtype
        if labels.size == 0:
            raise TrainingOpError(f"step: feed {name!r} is empty: a batch needs at least one "
                                  "example (the mean loss of none is undefined)")
        batch = feeds.get(batch_input)
        if batch is not None and labels.ndim:
            rows = np.shape(batch)
            if rows and labels.shape[0] != rows[0]:
                raise TrainingOpError(f"step: feed {name!r} has {labels.shape[0]} rows, input "
                                      f"{batch_input!r} has {rows[0]}: one label per example")
        if labels.view(unsigned[labels.itemsize]).max() < classes:
            return  # the common case, one reduction: a negative label is a huge unsigned one
        bad = (labels < 0) | (labels >= classes)
        if ignore is not None:
            bad &= labels != ignore
        if bad.any():
            value = labels[bad].reshape(-1)[0]
            raise TrainingOpError(
                f"step: feed {name!r} holds class {value}, outside [0, {classes})"
                + (f" and not ignore_index {ignore}" if ignore is not None else ""))

    return check


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
