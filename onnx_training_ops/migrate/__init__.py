"""Moving from onnxruntime-training: its artifacts and checkpoints become one training model.

* :func:`import_onnxruntime_training` — an artifact folder (eval model, optimizer model,
  checkpoint) -> a training model that continues the run (:mod:`.importer`);
* :func:`read_checkpoint` — its checkpoint flatbuffer as numpy arrays (:mod:`.checkpoint`,
  accessors written from the schema in :mod:`.checkpoint_schema`; needs ``flatbuffers``);
* :class:`OrtAdamW` — its AdamW kernel's formula in standard ONNX ops (:mod:`.adamw`).

docs/migrating.md maps every class and method of its on-device API to ours.
"""

from ..optim.ort_adamw import OrtAdamW
from .checkpoint import OrtCheckpoint, read_checkpoint
from .importer import import_onnxruntime_training

__all__ = ["OrtAdamW", "OrtCheckpoint", "import_onnxruntime_training", "read_checkpoint"]
