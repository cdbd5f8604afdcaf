"""onnx_training_ops: run ONNX's training domain (ai.onnx.preview.training) in stock onnxruntime.

Importing the package is cheap and changes nothing global: the Adam, Momentum and Adagrad
kernels are registered with onnxruntime-extensions when first needed (:func:`session_options`,
:func:`prepare`, :class:`InferenceSession`). Main entry points:

* :func:`prepare` — turn a training-domain graph into one onnxruntime accepts;
* :func:`session_options` — SessionOptions with the kernel library registered;
* :class:`InferenceSession` — drop-in ``onnxruntime.InferenceSession`` that prepares for you;
* :func:`build_training_model` — inference model + loss (:mod:`.losses`, torch's names) +
  :class:`Adam`/:class:`AdamW`/:class:`Momentum`/:class:`Adagrad`/:class:`RMSProp` (dense, or
  lazy/sparse rows for embedding tables) -> one ONNX training model (``training_info``);
* :class:`TrainingSession` — train any ONNX training model: ``step``, ``evaluate``,
  ``backward``/``optimizer_step``, ``run``, ``save``, ``export_inference_model``;
* :func:`add_lora` — peft's LoRA adapters beside an inference model's linear layers (4-bit
  ``MatMulNBits`` of onnxruntime-genai's models included, :mod:`.lora`); the session trains
  only them and ``save_adapter`` writes them for peft or onnxruntime-genai;
* :func:`import_onnxruntime_training` — onnxruntime-training's artifacts and checkpoint ->
  one training model that continues the run (:mod:`.migrate`, docs/migrating.md);
* :mod:`onnx_training_ops.schedules` — learning-rate schedules with torch's names;
* :mod:`onnx_training_ops.kernels` — the numpy reference kernels;
* :mod:`onnx_training_ops.backend` — the onnx backend API, for ``onnx.backend.test``.

The layers, bottom to top, and what each may import: ``docs/architecture.md``.
"""

from . import kernels, schedules
from ._version import __version__  # noqa: F401 - onnx_training_ops.__version__
from .builder import (
                    Adagrad,
                    Adam,
                    AdamW,
                    BCEWithLogitsLoss,
                    CrossEntropyLoss,
                    HuberLoss,
                    L1Loss,
                    LossScaling,
                    Momentum,
                    MSELoss,
                    RMSProp,
                    SmoothL1Loss,
                    build_training_model,
)
from .errors import TrainingOpError
from .lora import add_lora
from .migrate import OrtAdamW, import_onnxruntime_training
from .passes import PASSES
from .runtime import InferenceSession, prepare, session_options
from .schema import DOMAIN
from .training import NonFiniteLossError, TrainingSession

__all__ = [
    "DOMAIN",
    "PASSES",
    "Adagrad",
    "Adam",
    "AdamW",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "HuberLoss",
    "L1Loss",
    "LossScaling",
    "MSELoss",
    "SmoothL1Loss",
    "InferenceSession",
    "Momentum",
    "NonFiniteLossError",
    "OrtAdamW",
    "RMSProp",
    "TrainingOpError",
    "TrainingSession",
    "add_lora",
    "build_training_model",
    "import_onnxruntime_training",
    "kernels",
    "prepare",
    "schedules",
    "session_options",
]
