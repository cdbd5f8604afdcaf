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
* :mod:`onnx_training_ops.schedules` — learning-rate schedules with torch's names;
* :mod:`onnx_training_ops.kernels` — the numpy reference kernels;
* :mod:`onnx_training_ops.backend` — the onnx backend API, for ``onnx.backend.test``.
"""

from . import kernels
from .builder import build_training_model
from .errors import TrainingOpError
from .losses import (BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, L1Loss, MSELoss,
                     SmoothL1Loss)
from . import schedules
from .optimizers import Adagrad, Adam, AdamW, Momentum
from .rmsprop import RMSProp
from .passes import PASSES, prepare
from .plugin import session_options
from .schema import DOMAIN
from .session import InferenceSession
from .training import NonFiniteLossError, TrainingSession

__version__ = "0.1.0"

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
    "MSELoss",
    "SmoothL1Loss",
    "InferenceSession",
    "Momentum",
    "NonFiniteLossError",
    "RMSProp",
    "TrainingOpError",
    "TrainingSession",
    "build_training_model",
    "kernels",
    "prepare",
    "schedules",
    "session_options",
]
