"""A mixin of TrainingSession: :meth:`summary`, ``repr`` and :meth:`to_torch_state_dict`."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from onnx import numpy_helper

from ..errors import TrainingOpError
from ..storage.large_model import LargeModel
from .locked import locked
from .summary import ModelSummary, summary
from .torch_names import recorded_names, to_torch_names


class Introspection:
    """What a session trains (``self._model``, ``self._state``, ``self._meta``)."""

    def summary(self) -> ModelSummary:
        """Trainable and frozen tensors, optimizer and its state size, loss, gradient ops.

        Returns:
            A :class:`~onnx_training_ops.training.summary.ModelSummary` over the session's
            live state (``print`` it for a table).
        """
        return summary(self._model, self._state)

    def __repr__(self) -> str:  # cheap: no shape inference (summary() walks the graph)
        names = [n for n in self._meta.get("trainable", "").split(",") if n in self._state]
        count = sum(self._state[n].size for n in names)
        opt = self._meta.get("optimizer", "")
        opt = opt.split('"type": "', 1)[1].split('"', 1)[0] if '"type": "' in opt else "?"
        lr = ", ".join(f"{k}={v:g}" for k, v in self.learning_rates.items())
        return (f"<TrainingSession {len(names)} trainable tensors ({count:,} parameters), optimizer {opt} ({lr}), "
                f"loss {self._meta.get('loss')!r}, step {self.lr_schedule_step}, providers {self.providers}>")

    @locked
    def to_torch_state_dict(self, mapping: Mapping[str, dict] | None = None, tensors: bool = True) -> dict[str, Any]:
        """The current weights under torch's names, for ``module.load_state_dict``.

        Args:
            mapping: ``{initializer: {"torch": [names], "transpose": bool}}``; default: the
                mapping :func:`~onnx_training_ops.training.torch_names.record_torch_names`
                recorded in the model, else the initializers' own names (exports with
                ``dynamo=True, optimize=False`` name them as torch does), exporter-made
                names (``onnx::MatMul_3``, ``val_4``) left out.
            tensors: return ``torch.Tensor`` values (needs torch); False: numpy arrays.

        Returns:
            ``{torch name: tensor}`` holding copies of the weights (frozen ones too).

        Raises:
            TrainingOpError: the mapping names an initializer the model lacks, or torch is
                missing with ``tensors=True``.
        """
        proto = self._model.model_proto
        values: dict[str, np.ndarray] = {}
        for t in proto.graph.initializer:
            if t.name in self._state:
                values[t.name] = self._state[t.name].copy()
            elif isinstance(self._model, LargeModel):
                values[t.name] = np.array(self._model.array(t))
            else:
                values[t.name] = numpy_helper.to_array(t)
        out = to_torch_names(values, mapping if mapping is not None else recorded_names(proto))
        if not tensors:
            return out
        try:
            import torch
        except ImportError as error:
            raise TrainingOpError("to_torch_state_dict: torch is not installed; pass tensors=False "
                                  "for numpy arrays") from error
        return {k: torch.from_numpy(v) for k, v in out.items()}
