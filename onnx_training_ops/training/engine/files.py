"""The engine's checkpoint part: what ``save`` writes, the inference model it exports, properties."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import onnx

from ...builder.metadata import TrainingMetadata
from ...builder.model_metadata import META_PREFIX
from ...errors import TrainingOpError
from ...storage.large_model import LargeModel
from ...storage.model_files import load_model
from ...storage.save import save_model
from ...storage.snapshot import write_state
from ..graphs.inference import inference_model, with_outputs
from ..inputs.checks import checked_properties, stored_properties
from ..options.rates import LearningRates
from ..state.nominal import nominal_model
from .store import StateStore


class Checkpointer:
    """Writes one state store's model to disk: checkpoints (with the properties and the
    schedule's position) and inference models."""

    def __init__(self, store: StateStore, rates: LearningRates, meta: TrainingMetadata) -> None:
        """The checkpointer of ``store``, with the properties the model recorded.

        Args:
            store: the state written.
            rates: the learning rates (the schedule and its position go into checkpoints).
            meta: the builder's metadata (``properties``: the values a checkpoint restores).
        """
        self.store, self.rates, self.meta = store, rates, meta
        self.properties: dict[str, Any] = stored_properties(meta.properties or "{}")

    def snapshot(self, copy: bool = True) -> LargeModel:
        """The training model with the current state: copies of the state's arrays, or with
        ``copy=False`` the live arrays (for a writer holding the session's lock)."""
        state = self.store.arrays if copy else self.store.for_writing()
        return write_state(self.store.model, state, self.checkpoint_metadata(), copy=copy)

    def training_model(self) -> onnx.ModelProto | LargeModel:
        """The training model with the current state (``TrainingSession.training_model``)."""
        return self.snapshot().public(checksums=True)

    def checkpoint_metadata(self) -> dict[str, str]:
        """The metadata entries a checkpoint of this session carries (properties, schedule)."""
        return {META_PREFIX + "properties": checked_properties(self.properties) if self.properties else "",
                META_PREFIX + "lr_schedule": self.rates.to_json()}

    def save(self, path: str | os.PathLike, nominal: bool = False) -> str:
        """Write the training model with the current state, atomically (``TrainingSession.save``)."""
        if self.meta.shard is not None:
            raise TrainingOpError(
                "save: this session holds one rank's shard of the optimizer state (ZeRO-1); save through "
                "DistributedTrainingSession.save, which gathers the whole state into one checkpoint")
        if nominal:
            names = [*self.store.arrays, *self.store.parameters(trainable_only=False)]
            return save_model(nominal_model(self.snapshot(copy=False).to_proto(), names), path)
        self.store.check_filled("save")
        # the live state arrays, written under the lock: no copy of a large model's state
        return self.snapshot(copy=False).write(path, checksums=True)

    def export_inference_model(self, path: str | os.PathLike | None = None,
                               outputs: Sequence[str] | None = None) -> onnx.ModelProto | LargeModel:
        """The main graph with the trained weights (``TrainingSession.export_inference_model``)."""
        self.store.check_filled("export_inference_model")
        # written from the live state (under the lock: no copy; a device's tensors read one at
        # a time as the writer reaches them); returned over copies of it
        live = self.store.for_writing() if path is not None else self.store.arrays
        model = inference_model(self.store.model, live, with_state_values=True, copy=path is None)
        if outputs is not None:
            model = model.with_proto(with_outputs(model.model_proto, outputs))
        if not model.model_proto.graph.output:
            raise TrainingOpError("export_inference_model: the main graph has no outputs")
        if path is None:
            return model.public()
        model.write(path)
        return load_model(path, large=True)
