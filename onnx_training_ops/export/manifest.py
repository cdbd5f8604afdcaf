"""``manifest.json``: what a client needs to train with an export, in any language.

Version 1 holds (see ``docs/export.md`` for every field):

* ``files``: the step, eval and inference models and the state, each with the ops it uses;
* ``inputs`` / ``eval_inputs``: the data a step / an evaluation takes (name, dtype, shape
  with symbolic dims as strings), ``defaults`` for data inputs that had a stored value;
* ``learning_rates``: one input per parameter group, with its base rate and parameters;
* ``feedback``: state input <- the step output holding its new value;
* ``returned`` / ``eval_outputs``: what a step / an evaluation gives back (loss, ``grad_norm``);
* ``state``: each state variable's name, dtype, shape and role (parameter, optimizer,
  counter, buffer), in the step model's input order;
* ``optimizer`` and ``schedule``: the rate of optimizer step ``k`` is the schedule's, for
  ``k = counter + step_offset`` (both advance once per applied step).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np
import onnx

from ..errors import TrainingOpError
from ..training.arrays import np_dtype

FORMAT = "onnx-training-ops/export"
VERSION = 1
MANIFEST = "manifest.json"


def value_entry(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    """``{"name", "dtype", "shape"}`` of a graph input or output; symbolic dims as strings
    (their name, or ``"?"``), a shape of null when unknown."""
    tt = vi.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return {"name": vi.name, "dtype": np_dtype(tt.elem_type).name, "shape": shape}


def tensor_entry(name: str, array: np.ndarray, **extra: Any) -> dict[str, Any]:
    return {"name": name, "dtype": array.dtype.name, "shape": list(array.shape), **extra}


def state_roles(state: list[str], meta: Mapping[str, str], counter: str | None) -> dict[str, str]:
    """parameter (trained), optimizer (V, H...), counter (T) or buffer (other state: BatchNorm
    running statistics)."""
    trainable = set(filter(None, meta.get("trainable", "").split(",")))
    optimizer = {v for values in json.loads(meta.get("optimizer_state") or "{}").values() for v in values}
    roles = {}
    for name in state:
        roles[name] = ("parameter" if name in trainable else "optimizer" if name in optimizer
                       else "counter" if name == counter else "buffer")
    return roles


def learning_rate_entries(rates: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> list[dict[str, Any]]:
    """One entry per learning-rate input: name, dtype, base rate, and with parameter groups
    the group's name and parameters (without, the one rate drives every parameter)."""
    groups = {g["learning_rate"]: g for g in json.loads(meta.get("param_groups") or "[]")}
    entries = []
    for name, value in rates.items():
        extra = {"group": groups[name]["name"], "params": groups[name]["params"]} if name in groups else {}
        entries.append(tensor_entry(name, value, base=float(value.reshape(-1)[0]), **extra))
    return entries


def default_entries(defaults: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Inputs other than learning rates that had a stored value: kept in the manifest (small
    values only), so a client feeds it when the batch does not."""
    entries = {}
    for name, value in defaults.items():
        if value.size > 64:
            raise TrainingOpError(f"export: input {name!r} has a stored default of {value.size} elements; "
                                  "the exported graphs take plain inputs only and the manifest keeps small "
                                  "defaults (<= 64 elements): make it an initializer (not an input) or feed it")
        entries[name] = tensor_entry(name, value, values=value.reshape(-1).tolist())
    return entries


def write(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, separators=(",", ":")) + "\n").encode()


def read(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of an export directory, its format and version checked."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except OSError as error:
        raise TrainingOpError(f"{path!r}: cannot read the export's manifest: {error.strerror or error}") from None
    except ValueError as error:
        raise TrainingOpError(f"{path!r}: the manifest is not JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TrainingOpError(f"{path!r}: not an onnx-training-ops export manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise TrainingOpError(f"{path!r}: manifest version {manifest.get('version')!r}; this package reads "
                              f"version {VERSION}")
    return manifest
