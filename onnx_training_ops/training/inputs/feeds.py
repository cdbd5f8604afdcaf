"""Feeds of a training step: what each program takes, and the checks every step runs.

Binding them to a program happens in :mod:`..graphs.step` (this module knows no Program)."""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from ...errors import TrainingOpError
from ..arrays import dtype_name, np_dtype


@dataclass
class FeedSpec:
    name: str
    dtype: np.dtype
    shape: tuple | None  # ints, or None for a dynamic/symbolic dim; () for scalars; None: any rank
    # shapes fed and accepted before (a few per run): a step checks such a feed in one lookup
    accepted: set = field(default_factory=set, compare=False, repr=False)


@dataclass(frozen=True)
class Feed:
    """One input a session takes, like ``onnxruntime.NodeArg``: ``shape`` holds ints and None
    for a dimension of any size (None: any rank); ``optional`` inputs have a default."""

    name: str
    dtype: np.dtype
    shape: tuple | None
    optional: bool


def feed_list(required: list[FeedSpec], optional: list[FeedSpec]) -> list[Feed]:
    """The feeds of a program, required ones first, each name once."""
    out: dict[str, Feed] = {}
    for spec, is_optional in [*((s, False) for s in required), *((s, True) for s in optional)]:
        out.setdefault(spec.name, Feed(spec.name, spec.dtype, spec.shape, is_optional))
    return list(out.values())


def feed_spec(vi: onnx.ValueInfoProto) -> FeedSpec:
    """The dtype and shape a graph input must be fed with."""
    tt = vi.type.tensor_type
    shape = tuple(
        d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim
    ) if tt.HasField("shape") else None
    return FeedSpec(vi.name, np_dtype(tt.elem_type), shape)


def check_feed_names(feeds: Mapping[str, Any], required: Set[str], optional: Set[str],
                     where: str = "step") -> None:
    """Raise unless ``feeds`` holds every required name and nothing but required or optional names."""
    names = set(feeds)
    missing = required - names
    extra = names - required - optional
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing feed(s) {sorted(missing)}")
        if extra:
            parts.append(f"unknown feed(s) {sorted(extra)}")
        raise TrainingOpError(
            f"{where}: {'; '.join(parts)}; {where} takes {sorted(required)}"
            + (f" (and optionally {sorted(optional)})" if optional else "")
        )


def feed_array(spec: FeedSpec, value, where: str = "step") -> np.ndarray:
    """``value`` as a C-contiguous array of the spec's dtype and shape (raises if it is not one)."""
    if type(value) is np.ndarray and value.dtype == spec.dtype and value.shape in spec.accepted \
            and value.flags.c_contiguous:
        return value  # a native dtype equal to the spec's, a shape checked before
    array = value if type(value) is np.ndarray else np.asarray(value)
    if not array.dtype.isnative:  # e.g. '>f4' from a big-endian file: onnxruntime would misread it
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype != spec.dtype:
        raise TrainingOpError(
            f"{where}: feed {spec.name!r} must be {dtype_name(spec.dtype)}, found {dtype_name(array.dtype)}"
        )
    shape = spec.shape
    if shape is not None:
        if array.ndim != len(shape) or any(d is not None and d != a for d, a in zip(shape, array.shape)):
            expected = [d if d is not None else "?" for d in shape]
            raise TrainingOpError(
                f"{where}: feed {spec.name!r} must have shape {expected}, found {list(array.shape)}"
            )
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if len(spec.accepted) < 64:
        spec.accepted.add(array.shape)
    return array


def checked_learning_rate(lr, what: str = "step: lr") -> float:
    """``lr`` as a float, or a TrainingOpError: a finite real number >= 0, as the optimizers'
    own ``lr`` (``what`` names it in the message)."""
    if isinstance(lr, (bool, str, bytes)) or np.ndim(lr) != 0 or \
            (isinstance(lr, np.ndarray) and lr.dtype.kind not in "iuf"):
        raise TrainingOpError(f"{what} must be a real number, found {lr!r}")
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise TrainingOpError(f"{what} must be a real number, found {lr!r}") from None
    if not np.isfinite(value) or value < 0:
        raise TrainingOpError(f"{what} must be finite and >= 0, found {value}")
    return value
