"""Export a training step that any onnxruntime runs (JavaScript, Java, Objective-C, C...), and back.

:func:`export_step` writes the step, eval and inference models in standard ONNX ops, the
state as ``.safetensors`` and a versioned ``manifest.json`` (:mod:`.writer`);
:func:`load_state` brings a state trained elsewhere back into a TrainingSession
(:mod:`.importing`); :func:`open_export` opens an export as a TrainingSession whose update runs
in the graph, on any execution provider, the state resident on its device (:mod:`.device`: a
GPU with onnxruntime-gpu; :class:`DeviceTrainer` is its older front end). The JavaScript
trainer that runs an export lives in ``js/``; the format is described in ``docs/export.md``.
"""

from __future__ import annotations

from .device import DeviceTrainer, open_export
from .importing import load_state, read_state, session_from_export
from .writer import FILES, export_step

__all__ = ["FILES", "DeviceTrainer", "export_step", "load_state", "open_export", "read_state", "session_from_export"]
