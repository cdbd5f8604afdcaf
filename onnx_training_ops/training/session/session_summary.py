"""What a session trains, in words and in torch's names: ``repr`` and ``to_torch_state_dict``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import TrainingOpError
from ...storage.large_model import LargeModel
from ..state.torch_names import recorded_names, to_torch_names


def describe(state: Mapping[str, Any], meta: Mapping[str, str], rates: Mapping[str, float],
             step: int, providers: list[str], engine: str = "") -> str:
    """A session's one-line ``repr`` (cheap: no shape inference, unlike ``summary()``; ``state``
    gives sizes, no values; ``engine`` its strategies in words)."""
    names = [n for n in meta.get("trainable", "").split(",") if n in state]
    count = sum(state[n].size for n in names)
    opt = meta.get("optimizer", "")
    opt = opt.split('"type": "', 1)[1].split('"', 1)[0] if '"type": "' in opt else "?"
    lr = ", ".join(f"{k}={v:g}" for k, v in rates.items())
    return (f"<TrainingSession {len(names)} trainable tensors ({count:,} parameters), optimizer {opt} ({lr}), "
            f"loss {meta.get('loss')!r}, step {step}, providers {providers}"
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
