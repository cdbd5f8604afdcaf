"""Accessors for onnxruntime-training's checkpoint flatbuffer, written from its schema.

The schema is onnxruntime's ``onnxruntime/core/flatbuffers/schema/ort_training_checkpoint.fbs``
(root ``Checkpoint``, file identifier ``"ODTC"``), which includes ``ort.fbs`` for ``Tensor``.
Each class below is one table; each accessor reads the field at its vtable slot
(``4 + 2 * field index``, the flatbuffers rule) through the ``flatbuffers`` package, so no byte
is interpreted by hand. The field order, types and defaults, as the schema declares them::

    table Checkpoint { version:int32; module_state:ModuleState;
                       optimizer_groups:[OptimizerGroup]; property_bag:PropertyBag; }
    table ModuleState { requires_grad_params:[Tensor]; frozen_params:[Tensor];
                        is_nominal_state:bool; has_external_data:bool; }
    table OptimizerGroup { group_name:string; step:int64; initial_learning_rate:float;
                           optimizer_states:[ParameterOptimizerState]; }
    table ParameterOptimizerState { param_name:string; momentums:[Tensor]; }
    table PropertyBag { ints:[IntProperty]; floats:[FloatProperty]; strings:[StringProperty]; }
    table IntProperty { name:string; value:int64; }     (FloatProperty: float, StringProperty: string)
    table Tensor { name:string; doc_string:string; dims:[int64]; data_type:TensorDataType;
                   raw_data:[uint8]; string_data:[string]; external_data_offset:int64 = -1; }

``TensorDataType`` numbers are ONNX's ``TensorProto.DataType`` values (FLOAT = 1, INT64 = 7, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

try:
    import flatbuffers
    from flatbuffers import number_types as _n
except ImportError:  # pragma: no cover - exercised only without the extra
    flatbuffers = None

FILE_IDENTIFIER = b"ODTC"
T = TypeVar("T", bound="_Table")


def require_flatbuffers() -> None:
    """Raise ImportError with the install hint when the ``flatbuffers`` package is missing."""
    if flatbuffers is None:
        raise ImportError("reading onnxruntime-training checkpoints needs the flatbuffers package: "
                          "pip install 'onnx-training-ops[migrate]'")


class _Table:
    """One flatbuffers table: typed reads of field ``i`` (its vtable slot is ``4 + 2*i``)."""

    def __init__(self, buf: bytes, pos: int):
        self._tab = flatbuffers.table.Table(buf, pos)

    def _slot(self, field: int) -> int:
        return self._tab.Offset(4 + 2 * field)

    def _scalar(self, field: int, kind, default):
        o = self._slot(field)
        return self._tab.Get(kind, o + self._tab.Pos) if o else default

    def _string(self, field: int) -> str | None:
        o = self._slot(field)
        return self._tab.String(o + self._tab.Pos).decode("utf-8") if o else None

    def _tables(self, field: int, cls: Callable[[bytes, int], T]) -> list[T] | None:
        """A vector of tables, or None when the field is absent."""
        o = self._slot(field)
        if not o:
            return None
        start, length = self._tab.Vector(o), self._tab.VectorLen(o)
        return [cls(self._tab.Bytes, self._tab.Indirect(start + 4 * i)) for i in range(length)]

    def _table(self, field: int, cls: Callable[[bytes, int], T]) -> T | None:
        o = self._slot(field)
        return cls(self._tab.Bytes, self._tab.Indirect(o + self._tab.Pos)) if o else None

    def _numbers(self, field: int, kind) -> np.ndarray | None:
        o = self._slot(field)
        return self._tab.GetVectorAsNumpy(kind, o) if o else None


class Tensor(_Table):
    def name(self) -> str | None:
        return self._string(0)

    def dims(self) -> list[int]:
        dims = self._numbers(2, _n.Int64Flags)
        return [] if dims is None else [int(d) for d in dims]

    def data_type(self) -> int:
        return self._scalar(3, _n.Int32Flags, 0)

    def raw_data(self) -> np.ndarray | None:
        return self._numbers(4, _n.Uint8Flags)

    def has_string_data(self) -> bool:
        return bool(self._slot(5))

    def external_data_offset(self) -> int:
        return self._scalar(6, _n.Int64Flags, -1)


class ModuleState(_Table):
    def requires_grad_params(self) -> list[Tensor] | None:
        return self._tables(0, Tensor)

    def frozen_params(self) -> list[Tensor] | None:
        return self._tables(1, Tensor)

    def is_nominal_state(self) -> bool:
        return bool(self._scalar(2, _n.BoolFlags, False))

    def has_external_data(self) -> bool:
        return bool(self._scalar(3, _n.BoolFlags, False))


class ParameterOptimizerState(_Table):
    def param_name(self) -> str | None:
        return self._string(0)

    def momentums(self) -> list[Tensor] | None:
        return self._tables(1, Tensor)


class OptimizerGroup(_Table):
    def group_name(self) -> str | None:
        return self._string(0)

    def step(self) -> int:
        return self._scalar(1, _n.Int64Flags, 0)

    def initial_learning_rate(self) -> float:
        return self._scalar(2, _n.Float32Flags, 0.0)

    def optimizer_states(self) -> list[ParameterOptimizerState] | None:
        return self._tables(3, ParameterOptimizerState)


class _Property(_Table):
    """``name:string`` then ``value`` (int64, float or string by subclass)."""

    def name(self) -> str | None:
        return self._string(0)

    def value(self) -> int | float | str | None:
        raise NotImplementedError  # each kind reads its own field type


class IntProperty(_Property):
    def value(self) -> int:
        return self._scalar(1, _n.Int64Flags, 0)


class FloatProperty(_Property):
    def value(self) -> float:
        return self._scalar(1, _n.Float32Flags, 0.0)


class StringProperty(_Property):
    def value(self) -> str | None:
        return self._string(1)


class PropertyBag(_Table):
    def ints(self) -> list[IntProperty]:
        return self._tables(0, IntProperty) or []

    def floats(self) -> list[FloatProperty]:
        return self._tables(1, FloatProperty) or []

    def strings(self) -> list[StringProperty]:
        return self._tables(2, StringProperty) or []


class Checkpoint(_Table):
    @classmethod
    def root(cls, buf: bytes) -> Checkpoint:
        """The root table of a checkpoint buffer (its uoffset at byte 0)."""
        return cls(buf, flatbuffers.encode.Get(_n.UOffsetTFlags.packer_type, buf, 0))

    def version(self) -> int:
        return self._scalar(0, _n.Int32Flags, 0)

    def module_state(self) -> ModuleState | None:
        return self._table(1, ModuleState)

    def optimizer_groups(self) -> list[OptimizerGroup]:
        return self._tables(2, OptimizerGroup) or []

    def property_bag(self) -> PropertyBag | None:
        return self._table(3, PropertyBag)


def has_identifier(buf: bytes) -> bool:
    """True when bytes 4..8 hold the checkpoint's file identifier ``ODTC``."""
    return len(buf) >= 8 and flatbuffers.util.BufferHasIdentifier(buf, 0, FILE_IDENTIFIER)
