"""The builder's record in a training model, parsed once: :class:`TrainingMetadata`.

``build_training_model`` writes its choices into the model's ``metadata_props`` under the
``onnx_training_ops.`` prefix, as strings (JSON for the structured ones); sharding, nominal
files, checkpoints and ``export`` add a few more. :meth:`TrainingMetadata.parse` reads them
all once, checks each and refuses a malformed entry with a :class:`TrainingOpError` naming the
key, what was expected and what was found; the session, sharding and export then read typed
fields. :meth:`TrainingMetadata.to_props` writes the same strings the builder always wrote (the
file format is unchanged; keys this version does not know are kept in :attr:`extra` and written
back as they were).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import onnx

from ..errors import TrainingOpError
from .model_metadata import META_PREFIX, metadata

T = TypeVar("T")

# written by every build (an empty string when not set; a record with an optimizer is a build's), in
# this order: the file format
_ALWAYS = ("optimizer", "loss", "labels", "label_range", "label_shape", "learning_rate", "trainable",
           "optimizer_state", "mode", "seed")


@dataclass(frozen=True)
class LabelRange:
    """Cross-entropy's labels: ``classes`` classes, and the ``ignore_index`` torch skips (if any)."""

    classes: int
    ignore_index: int | None = None

    def to_text(self) -> str:
        return f"{self.classes},{'' if self.ignore_index is None else self.ignore_index}"


@dataclass(frozen=True)
class TrainingMetadata:
    """The builder's metadata of a training model, typed (see the module's docstring).

    Comma-separated lists are tuples, JSON entries their decoded values; an entry the model
    lacks (or holds empty) is ``None`` / an empty tuple. ``lora``, ``properties`` and
    ``lr_schedule`` stay JSON text: their own readers (:func:`onnx_training_ops.lora.spec.lora_spec`,
    ``storage.snapshot.stored_properties``, ``training.schedules.from_json``) check them.
    """

    optimizer: Mapping[str, Any] | None = None  # {"type": "Adam", "lr": ..., ...} (optim.registry.to_json)
    loss: tuple[str, ...] = ()  # the loss value(s) the algorithm graph computes
    labels: str | None = None  # the built loss's label/target input
    label_range: LabelRange | None = None  # cross-entropy's classes and ignore_index
    label_shape: Mapping[str, Any] | None = None  # the labels' layout against the output the loss reads
    learning_rate: tuple[str, ...] = ()  # the learning-rate input(s)
    trainable: tuple[str, ...] = ()  # the trained initializers, in the builder's order
    optimizer_state: Mapping[str, tuple[str, ...]] | None = None  # trainable -> its state variables
    mode: str | None = None  # "eval" or "train"
    seed: int | None = None  # the dropout masks' seed
    eval_loss: str | None = None  # the loss evaluate() returns, when not `loss` (mode="train")
    param_groups: tuple[Mapping[str, Any], ...] | None = None  # name, learning_rate, params, optimizer
    grad_norm: str | None = None  # the gradient norm's value (clip_grad_norm)
    sparse_updates: Mapping[str, str] | None = None  # trainable -> "rows" / "lazy"
    precision: str | None = None  # "fp16" / "bf16" (mixed precision)
    precision_provider: str | None = None
    precision_nodes: Mapping[str, Any] | None = None  # {"16-bit": [...], "fp32": [...]}
    loss_scaling: Mapping[str, Any] | None = None  # the loss scaler's settings and state names
    padding_rows: Mapping[str, int] | None = None  # embedding -> its padding row
    lora: str | None = None  # add_lora's record (JSON)
    nominal: tuple[str, ...] = ()  # the tensors a nominal file leaves empty (training.nominal)
    shard: Mapping[str, Any] | None = None  # {"rank": r, "world": w, "owned": [...]} (training.shard)
    properties: str | None = None  # a checkpoint's properties (JSON)
    lr_schedule: str | None = None  # a checkpoint's schedule and its position (JSON)
    imported_from: Mapping[str, Any] | None = None  # migrate: the onnxruntime-training checkpoint read
    extra: Mapping[str, str] = field(default_factory=dict)  # keys this version does not know, as found

    # -- reading ----------------------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> TrainingMetadata:
        """The builder's metadata of ``model`` (an empty record for a model the builder did not make)."""
        return cls.parse(metadata(model))

    @classmethod
    def parse(cls, props: Mapping[str, str]) -> TrainingMetadata:
        """``props`` (keys without the ``onnx_training_ops.`` prefix), checked and decoded."""
        known = {f.name for f in fields(cls)} - {"extra"}
        values: dict[str, Any] = {name: parser(name, props[name]) for name, parser in _PARSERS.items()
                                  if props.get(name)}
        values["extra"] = {k: v for k, v in props.items() if k not in known}
        return cls(**values)

    # -- writing ----------------------------------------------------------------------------------

    def to_props(self) -> dict[str, str]:
        """The entries as the builder writes them (keys without the prefix): the inverse of :meth:`parse`."""
        out: dict[str, str] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None or value == ():
                if f.name in _ALWAYS and self.optimizer is not None:
                    out[f.name] = ""
                continue
            out[f.name] = _WRITERS.get(f.name, json.dumps)(value)
        out.update(self.extra)
        return out

    def write(self, model: onnx.ModelProto) -> None:
        """Replace the builder's entries of ``model`` (in place) by this record."""
        from .model_metadata import set_metadata

        set_metadata(model, self.to_props())

    # -- derived ----------------------------------------------------------------------------------

    @property
    def built_loss(self) -> bool:
        """Whether the builder added a loss reading a label/target input."""
        return bool(self.labels)

    @property
    def evaluation_loss(self) -> str:
        """The loss evaluate() returns: ``eval_loss``, else the first ``loss`` (``""`` for none)."""
        return self.eval_loss or (self.loss[0] if self.loss else "")

    @property
    def group_rates(self) -> tuple[str, ...]:
        """The learning-rate inputs of the parameter groups (``param_groups``)."""
        return tuple(g["learning_rate"] for g in self.param_groups or ())

    def without_loss(self) -> TrainingMetadata:
        """This record without its loss (the optimizer step of a split program reads no loss)."""
        return replace(self, loss=(), eval_loss=None)


# -- the parsers, one per key: (key, text) -> value; a malformed entry raises ------------------------


def _malformed(key: str, expected: str, found: object) -> TrainingOpError:
    shown = found if isinstance(found, str) else json.dumps(found)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return TrainingOpError(f"the training model's metadata '{META_PREFIX}{key}' is malformed: expected "
                           f"{expected}, found {shown!r}")


def _json(expected_type: type[T], expected: str) -> Callable[[str, str], T]:
    def parse(key: str, text: str) -> T:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise _malformed(key, expected, text) from None
        if not isinstance(value, expected_type):
            raise _malformed(key, expected, text)
        return value

    return parse


def _names(key: str, text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


def _text(key: str, text: str) -> str:
    return text


def _int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _malformed(key, "an integer", text) from None


def _label_range(key: str, text: str) -> LabelRange:
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError(text)
        return LabelRange(int(parts[0]), int(parts[1]) if parts[1] else None)
    except ValueError:
        raise _malformed(key, "'<classes>,<ignore_index or empty>'", text) from None


def _string_lists(key: str, text: str) -> dict[str, tuple[str, ...]]:
    value = _json(dict, "a JSON object of lists of names")(key, text)
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in value.values()):
        raise _malformed(key, "a JSON object of lists of names", text)
    return {k: tuple(v) for k, v in value.items()}


def _name_list(key: str, text: str) -> tuple[str, ...]:
    value = _json(list, "a JSON list of names")(key, text)
    if not all(isinstance(n, str) for n in value):
        raise _malformed(key, "a JSON list of names", text)
    return tuple(value)


def _groups(key: str, text: str) -> tuple[dict[str, Any], ...]:
    value = _json(list, "a JSON list of groups")(key, text)
    if not all(isinstance(g, dict) and isinstance(g.get("learning_rate"), str) for g in value):
        raise _malformed(key, "a JSON list of groups, each with its 'learning_rate' input", text)
    return tuple(value)


def _padding(key: str, text: str) -> dict[str, int]:
    value = _json(dict, "a JSON object of row numbers")(key, text)
    if not all(isinstance(v, int) for v in value.values()):
        raise _malformed(key, "a JSON object of row numbers", text)
    return value


_OBJECT = _json(dict, "a JSON object")
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "optimizer": _OBJECT, "loss": _names, "labels": _text, "label_range": _label_range,
    "label_shape": _OBJECT, "learning_rate": _names, "trainable": _names, "optimizer_state": _string_lists,
    "mode": _text, "seed": _int, "eval_loss": _text, "param_groups": _groups, "grad_norm": _text,
    "sparse_updates": _OBJECT, "precision": _text, "precision_provider": _text, "precision_nodes": _OBJECT,
    "loss_scaling": _OBJECT, "padding_rows": _padding, "lora": _text, "nominal": _name_list, "shard": _OBJECT,
    "properties": _text, "lr_schedule": _text, "imported_from": _OBJECT,
}

_WRITERS: dict[str, Callable[[Any], str]] = {
    "loss": ",".join, "labels": str, "label_range": LabelRange.to_text, "learning_rate": ",".join,
    "trainable": ",".join, "optimizer_state": lambda v: json.dumps({k: list(n) for k, n in v.items()}),
    "mode": str, "seed": str, "eval_loss": str, "param_groups": lambda v: json.dumps(list(v)), "grad_norm": str,
    "precision": str, "precision_provider": str, "lora": str, "nominal": lambda v: json.dumps(list(v)),
    "properties": str, "lr_schedule": str,
}
