"""Part of :class:`~onnx_training_ops.TrainingSession`: checkpoints, exports, properties, profiles."""

from __future__ import annotations

import os
from typing import Any, Sequence

import onnx

from ..builder.model_metadata import META_PREFIX
from ..errors import TrainingOpError
from ..storage import checkpoint
from ..storage.large_model import LargeModel
from ..storage.tensors import attach
from ..storage.model_files import load_model
from ..storage.save import save_model
from ..storage.snapshot import write_state
from .checks import checked_properties
from .inference import inference_model, with_outputs
from .locked import locked
from .nominal import nominal_model


class Checkpointing:
    """A mixin of TrainingSession: what :meth:`save` writes and the inference model it exports."""

    @property
    def properties(self) -> dict[str, Any]:
        """User values (str, int, float, bool) saved atomically with each checkpoint and
        restored with it: epoch, best metric, data position (onnxruntime-training's
        ``CheckpointState`` properties)."""
        return self._properties

    @locked
    def training_model(self) -> onnx.ModelProto | LargeModel:
        """The training model with the current state as initializers, the properties and the
        schedule's position (what :meth:`save` writes). A large model comes back as a
        LargeModel whose arrays are copies of the state."""
        snapshot = write_state(self._model, self._state, self.checkpoint_metadata())
        if self._large:
            return snapshot
        return checkpoint.add_checksums(attach(snapshot))

    def checkpoint_metadata(self) -> dict[str, str]:
        """The metadata entries a checkpoint of this session carries (properties, schedule)."""
        return {META_PREFIX + "properties": checked_properties(self._properties) if self._properties else "",
                META_PREFIX + "lr_schedule": self._rates.to_json()}

    @locked
    def save(self, path: str | os.PathLike, nominal: bool = False) -> str:
        """Write the training model with the current state, atomically; reloading resumes bit-exact.

        Args:
            path: the checkpoint file (``.onnx``; a large model also writes one data file beside it).
            nominal: names, dtypes and shapes only (onnxruntime-training's nominal checkpoint): the
                graphs without the values of the state and the parameters, for a device that opens
                it and loads the parameters it receives (:meth:`load_flat_parameters`).

        Returns:
            The path written.

        Raises:
            TrainingOpError: the file cannot be written (``FileWriteError``, naming the path); the
                previous file at ``path`` is left whole.
        """
        if "shard" in self._meta:
            raise TrainingOpError(
                "save: this session holds one rank's shard of the optimizer state (ZeRO-1); save through "
                "DistributedTrainingSession.save, which gathers the whole state into one checkpoint")
        if nominal:
            names = [*self._state, *self._parameters(trainable_only=False)]
            model = self.training_model()
            return save_model(nominal_model(attach(model) if isinstance(model, LargeModel) else model, names), path)
        self._check_filled("save")
        if not self._large:
            return save_model(self.training_model(), path)
        # the live state arrays, streamed to disk under the lock: no copy of the state
        live = write_state(self._model, self._state, self.checkpoint_metadata(), copy=False)
        return save_model(live, path, checksums=True)

    @locked
    def export_inference_model(self, path: str | os.PathLike | None = None,
                               outputs: Sequence[str] | None = None) -> onnx.ModelProto | LargeModel:
        """The main graph with the trained weights and no ``training_info``.

        Args:
            path: where to write it, atomically (a large model with its weights in external
                data); None: only return it.
            outputs: the values it computes (any of the main graph; default its outputs), without
                what they do not need (onnxruntime-training's ``export_model_for_inferencing``).

        Returns:
            The inference model; a large model comes back as a LargeModel, memory-mapped from
            ``path`` when given, else over copies of the weights.

        Raises:
            TrainingOpError: an unknown output name, or a file that cannot be written.
        """
        self._check_filled("export_inference_model")
        live = self._large and path is not None  # streamed to disk under the lock: no copy
        model = inference_model(self._model, self._state, with_state_values=True, copy=not live)
        if outputs is not None:
            model = model.with_proto(with_outputs(model.model_proto, outputs))
        if not model.model_proto.graph.output:
            raise TrainingOpError("export_inference_model: the main graph has no outputs")
        if not self._large:
            model = attach(model)
            if path is not None:
                save_model(model, path)
            return model
        if path is None:
            return model
        save_model(model, path)
        return load_model(path, large=True)

    @locked
    def end_profiling(self) -> list[str]:
        """With ``sess_options.enable_profiling``: end profiling in every onnxruntime session
        this session opened (step programs, stages, evaluation, inference) and return the
        trace files onnxruntime wrote."""
        sessions = [p.session for p in self._programs] + [p.session for p in self._eval_programs.values()]
        if self._accumulation.built:
            backward, apply, _, _ = self._accumulation.programs()
            sessions += [backward.session, apply.session]
        if self._inference is not None:
            sessions.append(self._inference[0])
        return [path for path in (s.end_profiling() for s in sessions) if path]
