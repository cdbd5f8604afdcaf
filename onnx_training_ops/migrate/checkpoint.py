"""Reading an onnxruntime-training checkpoint file into numpy arrays.

:func:`read_checkpoint` walks the flatbuffer through :mod:`.checkpoint_schema` and returns an
:class:`OrtCheckpoint`: the parameters that require a gradient and the frozen ones (in file
order, which onnxruntime-training writes sorted by name), each optimizer group (its step count,
initial learning rate and per-parameter moments ``momentum0``/``momentum1``) and the property
bag. A *nominal* checkpoint (``generate_artifacts(nominal_checkpoint=True)``) holds names, dtypes
and shapes but no data: its tensors come back in ``shapes`` and the arrays stay empty.

Every defect is a :class:`TrainingOpError` naming the file: not a checkpoint, damaged, an
unknown version, a tensor whose bytes do not match its shape and dtype, data kept in an
external file (not supported: onnxruntime-training writes one only past 2 GB), a negative
step count or initial learning rate, NaN or infinite values, a negative AdamW second moment.

**What cannot be detected.** The format carries no checksum (the schema,
``ort_training_checkpoint.fbs``, has none). A flipped byte in the flatbuffer's offsets, sizes,
names, dims or types is caught by the checks above (or makes the file unreadable); a flipped
byte inside a tensor's raw values that leaves a finite number (any mantissa bit, most
exponent bits) or inside a non-negative step count reads as a valid, different checkpoint.
Our own checkpoints and exports carry SHA-256 digests and catch every flip.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx import helper

from ..errors import TrainingOpError
from . import checkpoint_schema as fbs

KNOWN_VERSIONS = (1, 2, 3)  # 1: the format; 2: + is_nominal_state; 3: + external data


@dataclass
class OptimizerGroup:
    """One optimizer group: ``step`` updates done, the initial learning rate, and per
    parameter its moments by name (AdamW: ``momentum0`` = first, ``momentum1`` = second)."""

    name: str
    step: int
    initial_learning_rate: float
    moments: dict[str, dict[str, np.ndarray]]


@dataclass
class OrtCheckpoint:
    """What an onnxruntime-training checkpoint holds (see the module docstring)."""

    path: str
    version: int
    trainable: dict[str, np.ndarray] = field(default_factory=dict)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    trainable_names: list[str] = field(default_factory=list)  # in file order (also when nominal)
    nominal: bool = False
    shapes: dict[str, tuple[np.dtype, tuple[int, ...]]] = field(default_factory=dict)
    optimizer_groups: list[OptimizerGroup] = field(default_factory=list)
    properties: dict[str, int | float | str] = field(default_factory=dict)


def _tensor(t: fbs.Tensor, path: str, nominal: bool) -> tuple[str, np.dtype, tuple[int, ...], np.ndarray | None]:
    name = t.name()
    if not name:
        raise TrainingOpError(f"{path}: a tensor without a name; the checkpoint is damaged")
    shape = tuple(t.dims())
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type()))
    except (KeyError, ValueError, TypeError):
        raise TrainingOpError(f"{path}: tensor {name!r} has data type {t.data_type()}, which is not "
                              "a numeric ONNX type") from None
    if t.has_string_data() or dtype.kind not in "biuf":
        raise TrainingOpError(f"{path}: tensor {name!r}: expected numeric data, found type {dtype}")
    if t.external_data_offset() >= 0:
        raise TrainingOpError(f"{path}: tensor {name!r} is stored in an external data file, which "
                              "this reader does not support (onnxruntime-training writes one past 2 GB)")
    raw = t.raw_data()
    if nominal:
        return name, dtype, shape, None
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = 0 if raw is None else raw.size
    if found != expected:
        raise TrainingOpError(f"{path}: tensor {name!r} of shape {list(shape)} and dtype {dtype} needs "
                              f"{expected} bytes, found {found}")
    if raw is None:
        return name, dtype, shape, np.empty(shape, dtype)
    return name, dtype, shape, raw.view(dtype.newbyteorder("<")).reshape(shape).astype(dtype)


def _tensors(tensors: list[fbs.Tensor] | None, what: str, path: str, nominal: bool, ckpt: OrtCheckpoint):
    if tensors is None:
        raise TrainingOpError(f"{path}: the module state has no {what} list; the checkpoint is damaged")
    out = {}
    for t in tensors:
        name, dtype, shape, array = _tensor(t, path, nominal)
        if name in ckpt.shapes:
            raise TrainingOpError(f"{path}: parameter {name!r} appears twice")
        ckpt.shapes[name] = (dtype, shape)
        if array is not None:
            out[name] = array
    return out


def _groups(root: fbs.Checkpoint, path: str) -> list[OptimizerGroup]:
    groups = []
    for g in root.optimizer_groups():
        states = g.optimizer_states()
        if states is None:
            raise TrainingOpError(f"{path}: optimizer group {g.group_name()!r} has no states list")
        moments: dict[str, dict[str, np.ndarray]] = {}
        for s in states:
            name = s.param_name()
            tensors = s.momentums()
            if not name or tensors is None:
                raise TrainingOpError(f"{path}: an optimizer state without a parameter name or moments")
            moments[name] = {}
            for t in tensors:
                moment, _, _, array = _tensor(t, path, nominal=False)
                assert array is not None  # read: not nominal
                moments[name][moment] = array
        step, rate = int(g.step()), float(g.initial_learning_rate())
        if step < 0:
            raise TrainingOpError(f"{path}: optimizer group {g.group_name()!r} has step {step}; a step count is "
                                  ">= 0 (the checkpoint is damaged)")
        if not np.isfinite(rate) or rate < 0:
            raise TrainingOpError(f"{path}: optimizer group {g.group_name()!r} has initial learning rate {rate}; "
                                  "expected a finite number >= 0 (the checkpoint is damaged)")
        for name, found in moments.items():
            second = found.get("momentum1")
            if second is not None and second.dtype.kind == "f" and (second < 0).any():
                raise TrainingOpError(f"{path}: moment 'momentum1' of {name!r} holds a negative value; AdamW's "
                                      "second moment is a mean of squares, >= 0 (the checkpoint is damaged)")
        groups.append(OptimizerGroup(g.group_name() or "", step, rate, moments))
    return groups


def _finite(tensors: dict[str, np.ndarray], what: str, path: str) -> None:
    """Refuse NaN or infinite values: a trained state holds none (and a flipped exponent bit often makes one)."""
    for name, array in tensors.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise TrainingOpError(f"{path}: {what} {name!r} holds NaN or infinite values (the checkpoint is "
                                  "damaged, or the run it saved had diverged)")


def _properties(root: fbs.Checkpoint, path: str) -> dict[str, int | float | str]:
    bag = root.property_bag()
    if bag is None:
        return {}
    out: dict[str, int | float | str] = {}
    for p in [*bag.ints(), *bag.floats(), *bag.strings()]:
        name, value = p.name(), p.value()
        if not name or value is None:
            raise TrainingOpError(f"{path}: a property without a name or value; the checkpoint is damaged")
        out[name] = value
    return out


def read_checkpoint(path: str | os.PathLike) -> OrtCheckpoint:
    """Read onnxruntime-training's checkpoint file at ``path`` (see the module docstring)."""
    fbs.require_flatbuffers()
    path = os.fspath(path)
    if Path(path).is_dir():
        raise TrainingOpError(f"{path}: a directory; onnxruntime-training (1.15 and later) writes its "
                              "checkpoint as one file (older .pbseq directories are not supported)")
    try:
        buf = Path(path).read_bytes()
    except OSError as e:
        raise TrainingOpError(f"{path}: cannot read the checkpoint: {e.strerror or e}") from None
    if not fbs.has_identifier(buf):
        raise TrainingOpError(f"{path}: not an onnxruntime-training checkpoint (expected the flatbuffer "
                              f"file identifier 'ODTC' at bytes 4-8, found {buf[4:8]!r})")
    try:
        root = fbs.Checkpoint.root(buf)
        version = root.version()
        if version not in KNOWN_VERSIONS:
            raise TrainingOpError(f"{path}: checkpoint version {version}; this reader knows versions "
                                  f"{list(KNOWN_VERSIONS)}")
        ckpt = OrtCheckpoint(path, version)
        module = root.module_state()
        if module is not None:
            if module.has_external_data():
                raise TrainingOpError(f"{path}: the parameters are stored in an external data file, "
                                      "which this reader does not support")
            ckpt.nominal = module.is_nominal_state()
            ckpt.trainable = _tensors(module.requires_grad_params(), "trainable-parameter", path,
                                      ckpt.nominal, ckpt)
            ckpt.trainable_names = list(ckpt.shapes)
            ckpt.frozen = _tensors(module.frozen_params(), "frozen-parameter", path, ckpt.nominal, ckpt)
        ckpt.optimizer_groups = _groups(root, path)
        ckpt.properties = _properties(root, path)
        _finite({**ckpt.trainable, **ckpt.frozen}, "parameter", path)
        for group in ckpt.optimizer_groups:
            for name, found in group.moments.items():
                _finite({f"{name}/{k}": v for k, v in found.items()}, "moment", path)
    except (struct.error, IndexError, TypeError, OverflowError, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, TrainingOpError):
            raise
        raise TrainingOpError(f"{path}: the checkpoint is damaged (its flatbuffer offsets point outside "
                              f"the file or at invalid data: {e})") from None
    return ckpt
