"""Every optimizer, registered here and only here.

Adding an optimizer: its module in this package (math, scalars, element, description,
lowering or standard-op update; :mod:`.adam` is the model) and one line in the tables below.
Nothing registers itself on import: :func:`from_json` reads every optimizer back whatever
else was imported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, is_dataclass

from ..errors import TrainingOpError
from . import adagrad, adam, momentum, ort_adamw, rmsprop
from ._lowering import Lowering
from .base import Optimizer

# the name to_json writes -> the description's class
OPTIMIZER_CLASSES: dict[str, type] = {
    "Adam": adam.Adam,
    "AdamW": adam.AdamW,
    "Momentum": momentum.Momentum,
    "Adagrad": adagrad.Adagrad,
    "RMSProp": rmsprop.RMSProp,
    "OrtAdamW": ort_adamw.OrtAdamW,
}

# descriptions whose update is written with standard ops (no op of the training domain) ->
# ``emit_update(ops, optimizer, r, t, xs, gs, states, new_xs, new_states, dtypes)``
STANDARD_OP_UPDATES: dict[type, Callable[..., None]] = {
    rmsprop.RMSProp: rmsprop.emit_update,
    ort_adamw.OrtAdamW: ort_adamw.emit_update,
}

# the training domain's op -> its lowering to standard ops (passes.lower_optimizers)
LOWERINGS: dict[str, Lowering] = {
    "Adam": adam.lower,
    "Momentum": momentum.lower,
    "Adagrad": adagrad.lower,
}


def to_json(optimizer: Optimizer) -> str:
    """``{"type": "Adam", "lr": ..., ...}``: how the builder records the optimizer in the model's metadata."""
    if not is_dataclass(optimizer) or isinstance(optimizer, type):
        raise TrainingOpError(f"{type(optimizer).__name__} is not an optimizer description (a dataclass instance); "
                              f"the registered ones: {', '.join(OPTIMIZER_CLASSES)}")
    return json.dumps({"type": type(optimizer).__name__, **asdict(optimizer)})


def from_json(text: str) -> Optimizer:
    """The optimizer :func:`to_json` wrote (any of :data:`OPTIMIZER_CLASSES`)."""
    return from_record(json.loads(text))


def from_record(record: dict) -> Optimizer:
    """The optimizer of :func:`to_json`'s record, decoded (the builder's metadata ``optimizer``)."""
    data = dict(record)
    cls = OPTIMIZER_CLASSES[data.pop("type")]
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    return cls(**data)
