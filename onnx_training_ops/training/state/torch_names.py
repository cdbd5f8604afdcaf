"""Trained weights back under torch's names: the mapping from a model's initializers to a ``state_dict``.

* ``torch.onnx.export(dynamo=True)`` names each initializer as torch does
  (``encoder.layer.0.attention.self.query.weight``): the builder records the graph
  signature's parameters and persistent buffers, and the other names of a tie
  (:mod:`~onnx_training_ops.builder.dynamo_params`); constants made in ``forward``
  (``torch.ones(C)``) are not torch's and are left out.
* ``torch.onnx.export(dynamo=False)`` keeps torch's names with ``do_constant_folding=False``;
  with constant folding (its default) it stores some weights transposed under names such as
  ``onnx::MatMul_398``. Equal-valued parameters merged into one initializer come back under
  their own names through the builder's untying.

:func:`record_torch_names` matches the initializers against the module's ``state_dict`` at
export time (by name, else by value, also transposed), gives back from the module's values the
parameters the export folded into constants (:mod:`~onnx_training_ops.builder.value_params`),
and records the result in the model's ``metadata_props`` under :data:`KEY`; the builder and
checkpoints keep it, and :meth:`TrainingSession.to_torch_state_dict` reads it. Without a
record the names are taken as they are. The record: ``{"onnx name": {"torch": ["name", ...],
"transpose": bool}}`` (several torch names for one tied tensor, GPT-2's ``lm_head.weight``);
given the module, also which parameters require a gradient
(:data:`~onnx_training_ops.builder.torch_record.PARAMETERS_KEY`: the builder's default
trainables, as torch's).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ...builder.torch_record import KEY, LOST_KEY, PARAMETERS_KEY, UNHELD_KEY
from ...builder.torch_record import read as read_record
from ...builder.torch_record import write as write_record
from ...builder.value_params import exporter_named, restore_from_values
from ...errors import TrainingOpError

__all__ = ["KEY", "record_torch_names", "recorded_names", "to_torch_names", "torch_name_map"]


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


_exporter_name = exporter_named


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
    inits = [t for t in model.graph.initializer if t.data_type in (1, 10, 11, 16)]
    for t in inits:  # by name: a scalar too (CLIP's logit_scale)
        if t.name in entries:
            names = [t.name, *tied(t.name)]
            out[t.name] = {"torch": names, "transpose": False}
            claimed.update(names)
    for t in inits:  # by value: tensors only (scalar constants are everywhere)
        if t.name in out or not _exporter_name(t.name) or not t.dims:
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


def record_torch_names(model: onnx.ModelProto, module: Any) -> onnx.ModelProto:
    """Record :func:`torch_name_map` in ``model.metadata_props`` (in place) and return ``model``;
    first give back, from torch's values, the parameters the export folded into constants.

    Args:
        model: the exported inference model, before training (any exporter, any settings).
        module: the exported ``torch.nn.Module`` (its ``state_dict``, and which parameters
            require a gradient: those are the builder's default trainables), or its
            ``state_dict()`` alone.

    Returns:
        ``model``, carrying the mapping under :data:`KEY`. A float parameter the export folded
        into a constant is an initializer of its own again where a computation on it gives
        the constant (rows looked up with constant ids, a transpose, ``exp``...); one found
        nowhere is recorded and named by a warning (unused by ``forward``, or folded beyond
        recognition: it will not train).
    """
    named = getattr(module, "named_parameters", None)
    state = module.state_dict() if named is not None else module
    grads = {n: bool(p.requires_grad) for n, p in named(remove_duplicate=False)} if named is not None else None
    entries = {k: _array(v) for k, v in state.items()}
    params = [n for n in (grads if grads is not None else entries) if n in entries
              and np.issubdtype(entries[n].dtype, np.floating)]
    mapping = torch_name_map(model, state)
    held = {n for entry in mapping.values() for n in entry["torch"]}
    storage = {k: (v.data_ptr() if hasattr(v, "data_ptr") else id(v)) for k, v in state.items()}
    missing = [n for n in params if n not in held and not any(storage[n] == storage[h] for h in held)]
    torch_names = set(entries)
    constants = [t.name for t in model.graph.initializer if t.name not in mapping and t.name not in torch_names]
    unique: dict[str, np.ndarray] = {}
    for n in params:  # one name per tensor (a tie is one parameter)
        if all(storage[n] != storage[u] for u in unique):
            unique[n] = entries[n]
    done, unheld = restore_from_values(model, unique, [n for n in missing if n in unique], constants)
    if done:
        mapping = torch_name_map(model, state)
        shown = ", ".join(f"{p} ({how}, was {c})" for p, c, how in done[:3])
        warnings.warn(f"record_torch_names: {len(done)} constant(s) the exporter had computed from torch parameters "
                      f"are computed from the parameters again, which train: {shown}"
                      f"{f' and {len(done) - 3} more' if len(done) > 3 else ''}", stacklevel=2)
    lost = _folded_batch_norms(model, module, entries, mapping) if named is not None else {}
    write_record(model, mapping, KEY)
    write_record(model, grads, PARAMETERS_KEY)
    write_record(model, lost or None, LOST_KEY)
    unheld = {n: why for n, why in unheld.items() if n not in lost and (grads is None or grads.get(n, True))}
    write_record(model, unheld or None, UNHELD_KEY)
    return model


def _folded_batch_norms(model: onnx.ModelProto, module: Any, entries: dict[str, np.ndarray],
                        mapping: dict[str, dict]) -> dict[str, str]:
    """The TorchScript exporter's ``do_constant_folding=True`` folds an eval-mode BatchNorm into
    the Conv before it: the Conv reads an exporter-named weight equal to ``W * gamma / sigma``
    and a new bias. Found by value (the module's BatchNorms, their ``eps``): ``{torch
    parameter: why}`` for the Conv's and the BatchNorm's parameters, which nothing in the model
    holds any more (a fused tensor that happens to equal one of them is unmapped)."""
    import torch

    norms = {name: m for name, m in module.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_var is not None and m.affine}
    inits = {t.name: t for t in model.graph.initializer}
    held = {n for entry in mapping.values() for n in entry["torch"]}
    lost: dict[str, str] = {}
    for node in model.graph.node:
        weight = node.input[1] if node.op_type == "Conv" and len(node.input) > 1 else ""
        if weight not in inits or not _exporter_name(weight) or weight in mapping:
            continue
        fused = numpy_helper.to_array(inits[weight]).astype(np.float64)
        for bn_name, bn in norms.items():
            assert bn.running_var is not None  # with running statistics: chosen above
            scale = (bn.weight.detach().double() / torch.sqrt(bn.running_var.double() + bn.eps)).numpy()
            if scale.shape[0] != fused.shape[0]:
                continue
            scale = scale.reshape(-1, *[1] * (fused.ndim - 1))
            found = [n for n, w in entries.items() if n not in held and w.shape == fused.shape
                     and np.allclose(w * scale, fused, rtol=1e-5, atol=1e-7 * float(np.abs(fused).max(initial=0)))]
            if len(found) != 1:
                continue
            conv = found[0].rpartition(".")[0]
            why = (f"do_constant_folding=True folded BatchNorm {bn_name!r} into Conv {conv!r}: the model holds only "
                   "their fused weight and bias")
            prefix = f"{bn_name}." if bn_name else ""
            for name in (found[0], f"{conv}.bias", f"{prefix}weight", f"{prefix}bias"):
                if name in entries:
                    lost[name] = why
            for fused_name in node.input[1:3]:
                mapping.pop(fused_name, None)
    return lost


def recorded_names(model: onnx.ModelProto) -> dict[str, dict] | None:
    """The mapping :func:`record_torch_names` recorded in ``model``, or None."""
    return read_record(model, KEY)


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
        if not isinstance(source, str) or source not in values:
            raise TrainingOpError(f"the torch-name mapping names initializer {name!r}, which the model lacks")
        value = values[source].T if entry.get("transpose") else values[source]
        for torch_name in entry["torch"]:
            out[torch_name] = np.ascontiguousarray(value)
    return out
