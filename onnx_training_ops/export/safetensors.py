"""The safetensors format now lives at :mod:`onnx_training_ops.storage.safetensors` (the LoRA
adapters below the training layer write it too); this path gives the same module object."""

import sys

from ..storage import safetensors as _safetensors

sys.modules[__name__] = _safetensors
