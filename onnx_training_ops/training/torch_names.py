"""Trained weights back under torch's names: the mapping from a model's initializers to a ``state_dict``.

* ``torch.onnx.export(dynamo=True, optimize=False)`` names each initializer as torch does
  (``encoder.layer.0.attention.self.query.weight``): the mapping is the identity.
* ``torch.onnx.export(dynamo=False)`` keeps torch's names with ``do_constant_folding=False``;
  with constant folding (its default) it stores some weights transposed under names such as
  ``onnx::MatMul_398``. Equal-valued parameters merged into one initializer come back under
  their own names through the builder's untying.

:func:`record_torch_names` matches the initializers against the module's ``state_dict`` at
export time (by name, else by value, also transposed) and records the result in the model's
``metadata_props`` under :data:`KEY`; the builder and checkpoints keep it, and
:meth:`TrainingSession.to_torch_state_dict` reads it. Without a record the names are taken
as they are (the dynamo case). The record: ``{"onnx name": {"torch": ["name", ...],
"transpose": bool}}`` (several torch names for one tied tensor, GPT-2's ``lm_head.weight``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import TrainingOpError

KEY = "torch.state_dict_names"  # outside the builder's prefix: build_training_model keeps it


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _exporter_name(name: str) -> bool:
    """A name the exporter made up (``onnx::MatMul_398``, ``/layer/Constant_output_0``, ``val_3``)."""
    return name.startswith(("/", "val_")) or "::" in name


def torch_name_map(model: onnx.ModelProto, state_dict: Mapping[str, Any]) -> dict[str, dict]:
    """Which ``state_dict`` entries each float initializer of ``model`` holds.

    Args:
        model: the exported inference model, before any training (its values are compared).
        state_dict: ``module.state_dict()`` of the module that was exported (tensors or arrays).

    Returns:
        ``{initializer: {"torch": [names], "transpose": bool}}``: an initializer named as an
        entry maps to it (and to the entries tied to it, which share its storage); an
        exporter-named initializer maps to the unclaimed entries equal to its value, or to
        its transpose; an ``Identity`` alias named as an entry (equal values the TorchScript
        exporter merged) maps to that entry, ``"alias_of"`` its source.

    Raises:
        TrainingOpError: an exporter-named initializer equals several untied entries (equal
            random-init values: perturb the weights before exporting).
    """
    entries = {k: _array(v) for k, v in state_dict.items()}
    storage = {k: (v.data_ptr() if hasattr(v, "data_ptr") else id(v)) for k, v in state_dict.items()}

    def tied(name: str) -> list[str]:
        return [k for k in entries if storage[k] == storage[name] and k != name]

    out: dict[str, dict] = {}
    claimed: set[str] = set()
    inits = [t for t in model.graph.initializer if t.data_type in (1, 10, 11, 16) and len(t.dims) > 0]
    for t in inits:
        if t.name in entries:
            names = [t.name, *tied(t.name)]
            out[t.name] = {"torch": names, "transpose": False}
            claimed.update(names)
    for t in inits:
        if t.name in out or not _exporter_name(t.name):
            continue
        value = numpy_helper.to_array(t)
        for transpose in (False, True):
            probe = value.T if transpose else value
            found = [k for k, v in entries.items() if k not in claimed and v.shape == probe.shape
                     and v.dtype == probe.dtype and np.array_equal(v, probe)]
            groups = {storage[k] for k in found}
            if len(groups) > 1:
                raise TrainingOpError(
                    f"initializer {t.name!r} equals {len(groups)} different torch tensors ({', '.join(found)}): "
                    "perturb equal-valued weights before export, or pass the mapping yourself")
            if found:
                out[t.name] = {"torch": found, "transpose": transpose}
                claimed.update(found)
                break
    for node in model.graph.node:  # equal values the TorchScript exporter merged: Identity aliases
        source = node.input[0] if node.op_type == "Identity" and node.input else None
        if source in out and node.output[0] in entries and node.output[0] not in claimed:
            out[node.output[0]] = {"torch": [node.output[0]], "transpose": out[source]["transpose"],
                                   "alias_of": source}
            claimed.add(node.output[0])
    return out


def record_torch_names(model: onnx.ModelProto, state_dict: Mapping[str, Any]) -> onnx.ModelProto:
    """Record :func:`torch_name_map` in ``model.metadata_props`` (in place) and return ``model``.

    Args:
        model: the exported inference model, before training.
        state_dict: ``module.state_dict()`` of the exported module.

    Returns:
        ``model``, carrying the mapping under :data:`KEY`.
    """
    mapping = torch_name_map(model, state_dict)
    kept = [m for m in model.metadata_props if m.key != KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=KEY, value=json.dumps(mapping))
    return model


def recorded_names(model: onnx.ModelProto) -> dict[str, dict] | None:
    """The mapping :func:`record_torch_names` recorded in ``model``, or None."""
    for m in model.metadata_props:
        if m.key == KEY:
            try:
                return json.loads(m.value)
            except json.JSONDecodeError as error:
                raise TrainingOpError(f"metadata {KEY!r} is not JSON: {error}") from error
    return None


def to_torch_names(values: Mapping[str, np.ndarray], mapping: Mapping[str, dict] | None) -> dict[str, np.ndarray]:
    """``values`` (initializer name -> array) under torch's names.

    Args:
        values: the model's initializers with their current values.
        mapping: a :func:`torch_name_map` result; None: the names as they are, except
            exporter-made ones (the dynamo ``optimize=False`` case).

    Returns:
        ``{torch name: array}`` (transposed back where the exporter stored a transpose).
    """
    if mapping is None:
        return {k: v for k, v in values.items() if not _exporter_name(k) and v.ndim > 0}
    out = {}
    for name, entry in mapping.items():
        source = name if name in values else entry.get("alias_of")  # untied by the builder, or not
        if source not in values:
            raise TrainingOpError(f"the torch-name mapping names initializer {name!r}, which the model lacks")
        value = values[source].T if entry.get("transpose") else values[source]
        for torch_name in entry["torch"]:
            out[torch_name] = np.ascontiguousarray(value)
    return out
