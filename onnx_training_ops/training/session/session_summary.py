"""What a session trains, in words and in torch's names: ``repr`` and ``to_torch_state_dict``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...storage.large_model import LargeModel
from ..state.torch_names import recorded_names, to_torch_names


def describe(state: Mapping[str, Any], meta: TrainingMetadata, rates: Mapping[str, float],
             step: int, providers: list[str], engine: str = "") -> str:
    """A session's one-line ``repr`` (cheap: no shape inference, unlike ``summary()``; ``state``
    gives sizes, no values; ``engine`` its strategies in words)."""
    names = [n for n in meta.trainable if n in state]
    count = sum(state[n].size for n in names)
    opt = (meta.optimizer or {}).get("type", "?")
    lr = ", ".join(f"{k}={v:g}" for k, v in rates.items())
    return (f"<TrainingSession {len(names)} trainable tensors ({count:,} parameters), optimizer {opt} ({lr}), "
            f"loss {','.join(meta.loss) or None!r}, step {step}, providers {providers}"
            f"{f', {engine}' if engine else ''}>")


def torch_state_dict(model: LargeModel, state: Mapping[str, np.ndarray], mapping: Mapping[str, dict] | None,
                     tensors: bool) -> dict[str, Any]:
    """The weights (state or constants of ``model``) under torch's names (``to_torch_state_dict``)."""
    proto = model.model_proto
    values: dict[str, np.ndarray] = {}
    for t in proto.graph.initializer:
        values[t.name] = state[t.name].copy() if t.name in state else np.array(model.array(t))
    out = to_torch_names(values, mapping if mapping is not None else recorded_names(proto))
    if not tensors:
        return out
    try:
        import torch
    except ImportError as error:
        raise TrainingOpError("to_torch_state_dict: torch is not installed; pass tensors=False "
                              "for numpy arrays") from error
    return {k: torch.from_numpy(v) for k, v in out.items()}
