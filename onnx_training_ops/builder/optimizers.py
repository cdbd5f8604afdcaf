"""Optimizer descriptions for :func:`onnx_training_ops.build_training_model`, with PyTorch's names.

Each class is a small frozen dataclass: the hyper-parameters a PyTorch user knows, their
mapping to the attributes of the ``ai.onnx.preview.training`` op (:meth:`attributes`), the
optimizer state each parameter needs and its initial value (:attr:`states`,
:meth:`initial_value`), and the update count the op receives. They live with their other
forms in :mod:`onnx_training_ops.optim` (one module per optimizer, the contract in
:class:`onnx_training_ops.optim.base.Optimizer`, all listed in
:mod:`onnx_training_ops.optim.registry`); this module keeps the builder's names.

Mapping to ``torch.optim`` (checked by ``tests/test_torch_parity.py``):

==============================================  ================================================
torch                                           ONNX op attributes / state
==============================================  ================================================
``SGD(lr, momentum, dampening, nesterov,        ``Momentum(alpha=momentum, beta=1-dampening,
weight_decay)``                                 mode="nesterov"|"standard",
                                                norm_coefficient=weight_decay)``, V starts at 0,
                                                the op receives T = step-1 (0 on the first step:
                                                torch's "buf = grad" first step is ONNX's
                                                ``beta_adjusted = 1`` at T = 0)
``Adagrad(lr, lr_decay, eps, weight_decay,      ``Adagrad(decay_factor=lr_decay, epsilon=eps,
initial_accumulator_value)``                    norm_coefficient=weight_decay)``, H starts at
                                                ``initial_accumulator_value``, T = step-1
``Adam(lr, betas, eps, weight_decay)``          ``Adam(alpha=betas[0], beta=betas[1],
                                                epsilon=eps, norm_coefficient=weight_decay,
                                                norm_coefficient_post=post_weight_decay)``,
                                                V = H = 0, the op receives T = step (1-based)
==============================================  ================================================

Adam's epsilon and AdamW's decay: :mod:`onnx_training_ops.optim.adam`.
"""

from __future__ import annotations

from ..optim._checks import _real
from ..optim._checks import check_finite as _check_finite
from ..optim._checks import check_nonnegative as _check_nonnegative
from ..optim.adagrad import Adagrad
from ..optim.adam import Adam, AdamW
from ..optim.base import Optimizer
from ..optim.momentum import Momentum
from ..optim.registry import OPTIMIZER_CLASSES, from_json, to_json

__all__ = ["Adam", "AdamW", "Momentum", "Adagrad", "Optimizer", "OPTIMIZER_CLASSES", "to_json", "from_json",
           "_real", "_check_finite", "_check_nonnegative"]
