"""The training-model builder: inference model + loss + optimizer -> one ONNX training model.

:func:`build_training_model` (:mod:`.model`) runs named steps, each in its own module:

* :mod:`.train_mode` — the training-mode forward pass (BatchNorm batch statistics, Dropout);
* :mod:`.loss_graph` — the loss nodes, on :mod:`.losses` (torch's loss classes);
* :mod:`.trainables` — which initializers train, every op on the way differentiable;
* :mod:`.update` — learning rates, T + 1, the Gradient node, clipping (:mod:`.grad_clip`),
  the optimizers (:mod:`.optimizers`, :mod:`.rmsprop`, emitted by :mod:`.emit_update`) per
  parameter group (:mod:`.param_groups`), row updates of tables (:mod:`.sparse_updates`);
* :mod:`.loss_scaling` — dynamic loss scaling for mixed precision (``precision=``; the 16-bit
  graph itself is :mod:`onnx_training_ops.passes.mixed_precision`);
* :mod:`.padding_rows` — ``nn.Embedding(padding_idx=...)``: the rows read from a dynamo export
  (or given), the tables' lookups marked for the ``Gather`` derivative rule;
* :mod:`.initialization` — the initialization graph;
* :mod:`.algorithm`, :mod:`.ops` — the algorithm graph under construction, node emission;
* :mod:`.model_metadata`, :mod:`.metadata` — what the builder records in the model for the session to read
  (:class:`.metadata.TrainingMetadata`: parsed once, typed).

May import: errors, schema, walk, storage, optim, autodiff, passes (never runtime or training: a
model is built without onnxruntime).
"""

from ..optim.adagrad import Adagrad
from ..optim.adam import Adam, AdamW
from ..optim.momentum import Momentum
from ..optim.rmsprop import RMSProp
from .loss_scaling import LossScaling
from .losses import BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, L1Loss, MSELoss, SmoothL1Loss
from .metadata import TrainingMetadata
from .model import build_training_model
from .model_metadata import META_PREFIX, metadata

__all__ = ["Adagrad", "Adam", "AdamW", "BCEWithLogitsLoss", "CrossEntropyLoss", "HuberLoss", "L1Loss",
           "LossScaling", "META_PREFIX", "MSELoss", "Momentum", "RMSProp", "SmoothL1Loss", "TrainingMetadata",
           "build_training_model", "metadata"]
