"""onnx_training_ops: run ONNX's training domain (ai.onnx.preview.training) in stock onnxruntime.

Importing the package registers the Adam, Momentum and Adagrad kernels with
onnxruntime-extensions. Main entry points:

* :func:`prepare` — turn a training-domain graph into one onnxruntime accepts;
* :func:`session_options` — SessionOptions with the kernel library registered;
* :class:`InferenceSession` — drop-in ``onnxruntime.InferenceSession`` that prepares for you;
* :func:`build_training_model` — inference model + loss (:mod:`.losses`, torch's names) +
  Adam/Momentum/Adagrad/RMSProp (dense, or lazy/sparse rows for embedding tables) -> one ONNX training model (``training_info``);
* :class:`TrainingSession` — train any ONNX training model: ``step``, ``run``, ``save``, ``export_inference_model``;
* :mod:`onnx_training_ops.kernels` — the numpy reference kernels;
* :mod:`onnx_training_ops.backend` — the onnx backend API, for ``onnx.backend.test``.
"""

from . import kernels
from .builder import build_training_model
from .errors import TrainingOpError
from .losses import (BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, L1Loss, MSELoss,
                     SmoothL1Loss)
from .optimizers import Adagrad, Adam, Momentum
from .rmsprop import RMSProp
from .passes import PASSES, prepare
from .plugin import register as _register
from .plugin import session_options
from .schema import DOMAIN
from .session import InferenceSession
from .training import NonFiniteLossError, TrainingSession

_register()

__version__ = "0.1.0"

__all__ = [
    "DOMAIN",
    "PASSES",
    "Adagrad",
    "Adam",
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
    "session_options",
]
