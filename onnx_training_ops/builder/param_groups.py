"""Parameter groups, as ``torch.optim`` param groups but chosen by name pattern.

``build_training_model(..., param_groups=[{"params": ["*.bias", "*norm*"], "weight_decay": 0.0},
{"params": [re.compile(r"encoder\\.layer\\.[0-5]\\.")], "lr": 1e-5}, {"params": ["embed*"],
"frozen": True}])``

* ``params``: glob patterns (:func:`fnmatch.fnmatchcase`) or compiled regular expressions
  (``re.Pattern``, matched with ``search``) over the trainables' names; each trainable
  joins the **first** group that matches it, the rest form the default group (the
  optimizer's own values).
* any field of the optimizer (``lr``, ``weight_decay``, ``betas``, ``eps``, ``momentum``,
  ...) overrides the optimizer's value for the group, as in torch;
* ``frozen: True``: the group's parameters are not trained (no gradient, no state);
* ``name``: names the group's learning-rate input ``<learning_rate>.<name>`` (default
  ``group<i>``); the default group keeps ``<learning_rate>``.

Each group becomes one optimizer node with its own learning-rate input (default value the
group's ``lr``), so a schedule scales every group from its own base rate, as torch's do.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import TrainingOpError
from ..optim.base import Optimizer
from ..optim.registry import to_json

_GROUP_KEYS = {"params", "frozen", "name"}


@dataclass
class Group:
    """One optimizer node's worth of parameters."""

    name: str
    optimizer: Optimizer
    params: list[str]
    learning_rate: str  # the name of its learning-rate input


def matches(pattern, name: str) -> bool:
    """Whether a group's pattern (glob or ``re.compile``) matches a name."""
    if isinstance(pattern, re.Pattern):
        return pattern.search(name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def frozen_by(param_groups: Sequence[Mapping] | None, name: str) -> bool:
    """Whether ``name`` would join a ``frozen`` group (the first group matching it; the groups
    are checked by :func:`resolve_groups`)."""
    for group in param_groups or ():
        given: object = group  # from the caller, not checked yet
        patterns = given.get("params") if isinstance(given, Mapping) else None
        patterns = [patterns] if isinstance(patterns, (str, re.Pattern)) else list(patterns or ())
        if any(isinstance(p, (str, re.Pattern)) and matches(p, name) for p in patterns):
            return bool(group.get("frozen", False))
    return False


def _described(optimizer: Optimizer) -> Any:
    """``optimizer`` as the dataclass every optimizer description is (the Protocol cannot say so)."""
    if not dataclasses.is_dataclass(optimizer) or isinstance(optimizer, type):
        raise TrainingOpError(f"{type(optimizer).__name__} is not an optimizer description (a dataclass instance)")
    return optimizer


def _checked(i: int, group: Any, optimizer: Optimizer) -> dict:
    if not isinstance(group, Mapping):
        raise TrainingOpError(f"param_groups[{i}] must be a dict like {{'params': ['*.bias'], "
                              f"'weight_decay': 0.0}}, found {type(group).__name__}")
    patterns = group.get("params")
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    if not patterns or not all(isinstance(p, (str, re.Pattern)) for p in patterns):
        raise TrainingOpError(f"param_groups[{i}]['params'] must be glob patterns or re.compile(...) "
                              f"patterns, found {group.get('params')!r}")
    fields = {f.name for f in dataclasses.fields(_described(optimizer))}
    unknown = sorted(set(group) - fields - _GROUP_KEYS)
    if unknown:
        raise TrainingOpError(f"param_groups[{i}]: unknown key(s) {unknown}; a group takes "
                              f"{sorted(_GROUP_KEYS)} and the fields of "
                              f"{type(optimizer).__name__}: {sorted(fields)}")
    name = group.get("name", f"group{i}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise TrainingOpError(f"param_groups[{i}]['name'] must be letters, digits, '_', '.' or "
                              f"'-', found {name!r}")
    return {**group, "params": list(patterns), "name": name}


def resolve_groups(trainables: Sequence[str], param_groups: Sequence[Mapping] | None,
                   optimizer: Optimizer, learning_rate: str) -> tuple[list[Group], list[str]]:
    """(the groups that train, in order with the default group last; the frozen names)."""
    if param_groups is None:
        return [Group("default", optimizer, list(trainables), learning_rate)], []
    if isinstance(param_groups, Mapping) or not isinstance(param_groups, Sequence):
        raise TrainingOpError("param_groups must be a list of dicts, e.g. "
                              "[{'params': ['*.bias'], 'weight_decay': 0.0}]")
    specs = [_checked(i, g, optimizer) for i, g in enumerate(param_groups)]
    names = [s["name"] for s in specs]
    if len(set(names)) != len(names):
        raise TrainingOpError(f"param_groups: group names repeat: {names}")
    members: list[list[str]] = [[] for _ in specs]
    rest = []
    for param in trainables:
        for i, spec in enumerate(specs):
            if any(matches(p, param) for p in spec["params"]):
                members[i].append(param)
                break
        else:
            rest.append(param)
    groups, frozen = [], []
    for i, (spec, params) in enumerate(zip(specs, members)):
        if not params:
            raise TrainingOpError(
                f"param_groups[{i}] ({spec['name']}) matches no trainable: patterns "
                f"{[p.pattern if isinstance(p, re.Pattern) else p for p in spec['params']]}; "
                f"trainables: {', '.join(trainables)}")
        if spec.get("frozen", False):
            frozen += params
            continue
        overrides = {k: v for k, v in spec.items() if k not in _GROUP_KEYS}
        if "betas" in overrides:
            overrides["betas"] = tuple(overrides["betas"])
        groups.append(Group(spec["name"], dataclasses.replace(_described(optimizer), **overrides), params,
                            f"{learning_rate}.{spec['name']}"))
    if rest:
        groups.append(Group("default", optimizer, rest, learning_rate))
    if not groups:
        raise TrainingOpError("param_groups freeze every trainable: nothing to train")
    return groups, frozen


def groups_record(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """How the builder records the groups in the model's metadata (``param_groups``)."""
    return [{"name": g.name, "learning_rate": g.learning_rate, "params": g.params,
             "optimizer": json.loads(to_json(g.optimizer))} for g in groups]
