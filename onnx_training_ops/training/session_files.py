"""A session's checkpoint part: what ``save`` writes, the inference model it exports, properties."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import onnx

from ..builder.model_metadata import META_PREFIX
from ..errors import TrainingOpError
from ..storage import checkpoint
from ..storage.large_model import LargeModel
from ..storage.model_files import load_model
from ..storage.save import save_model
from ..storage.snapshot import write_state
from ..storage.tensors import attach
from .checks import checked_properties, stored_properties
from .inference import inference_model, with_outputs
from .nominal import nominal_model
from .rates import LearningRates
from .state_store import StateStore


class Checkpointer:
    """Writes one state store's model to disk: checkpoints (with the properties and the
    schedule's position) and inference models."""

    def __init__(self, store: StateStore, rates: LearningRates, meta: Mapping[str, str], large: bool) -> None:
        """The checkpointer of ``store``, with the properties the model recorded.

        Args:
            store: the state written.
            rates: the learning rates (the schedule and its position go into checkpoints).
            meta: the builder's metadata (``properties``: the values a checkpoint restores).
            large: the model is large (streamed to disk, LargeModels returned).
        """
        self.store, self.rates, self.meta, self.large = store, rates, meta, large
        self.properties: dict[str, Any] = stored_properties(meta.get("properties") or "{}")

    def training_model(self) -> onnx.ModelProto | LargeModel:
        """The training model with the current state (``TrainingSession.training_model``)."""
        snapshot = write_state(self.store.model, self.store.arrays, self.checkpoint_metadata())
        if self.large:
            return snapshot
        return checkpoint.add_checksums(attach(snapshot))

    def checkpoint_metadata(self) -> dict[str, str]:
        """The metadata entries a checkpoint of this session carries (properties, schedule)."""
        return {META_PREFIX + "properties": checked_properties(self.properties) if self.properties else "",
                META_PREFIX + "lr_schedule": self.rates.to_json()}

    def save(self, path: str | os.PathLike, nominal: bool = False) -> str:
        """Write the training model with the current state, atomically (``TrainingSession.save``)."""
        if "shard" in self.meta:
            raise TrainingOpError(
                "save: this session holds one rank's shard of the optimizer state (ZeRO-1); save through "
                "DistributedTrainingSession.save, which gathers the whole state into one checkpoint")
        if nominal:
            names = [*self.store.arrays, *self.store.parameters(trainable_only=False)]
            model = self.training_model()
            return save_model(nominal_model(attach(model) if isinstance(model, LargeModel) else model, names), path)
        self.store.check_filled("save")
        if not self.large:
            return save_model(self.training_model(), path)
        # the live state arrays, streamed to disk under the lock: no copy of the state
        live = write_state(self.store.model, self.store.for_writing(), self.checkpoint_metadata(), copy=False)
        return save_model(live, path, checksums=True)

    def export_inference_model(self, path: str | os.PathLike | None = None,
                               outputs: Sequence[str] | None = None) -> onnx.ModelProto | LargeModel:
        """The main graph with the trained weights (``TrainingSession.export_inference_model``)."""
        self.store.check_filled("export_inference_model")
        live = self.large and path is not None  # streamed to disk under the lock: no copy
        model = inference_model(self.store.model, self.store.for_writing() if live else self.store.arrays,
                                with_state_values=True, copy=not live)
        if outputs is not None:
            model = model.with_proto(with_outputs(model.model_proto, outputs))
        if not model.model_proto.graph.output:
            raise TrainingOpError("export_inference_model: the main graph has no outputs")
        if not self.large:
            model = attach(model)
            if path is not None:
                save_model(model, path)
            return model
        if path is None:
            return model
        save_model(model, path)
        return load_model(path, large=True)
