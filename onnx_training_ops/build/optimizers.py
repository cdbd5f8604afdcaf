"""Optimizer descriptions for :func:`onnx_training_ops.build_training_model`, with PyTorch's names.

Each class is a small frozen dataclass: the hyper-parameters a PyTorch user knows, their
mapping to the attributes of the ``ai.onnx.preview.training`` op (:meth:`attributes`), the
optimizer state each parameter needs and its initial value (:attr:`states`,
:meth:`initial_value`), and the update count the op receives.

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

Adam's ``eps`` is not torch's: ONNX (like TensorFlow's ``ApplyAdam``) adds epsilon to
``sqrt(H)`` *before* the bias correction, ``X -= R*sqrt(1-beta^T)/(1-alpha^T) * V/(sqrt(H)+eps)``,
while torch adds it after, ``X -= R/(1-alpha^T) * V/(sqrt(H)/sqrt(1-beta^T)+eps)``. The two
agree exactly when ``eps == 0`` and agree with TF's formula for every eps ("epsilon hat").
The ONNX op skips the bias correction when T == 0, so the training graph feeds it T + 1
(the 1-based step number) to match torch and TF from the first step on; the state
variable T itself counts the steps done (0 before the first).

``post_weight_decay`` is ONNX's ``norm_coefficient_post``: ``X_final = (1 - c) * X_new`` after
the update, not scaled by the learning rate. torch's ``AdamW(weight_decay=w)`` multiplies by
``1 - lr*w`` *before* the update: :class:`AdamW` does exactly that, with standard ONNX ops
in front of the Adam node (``X * (1 - R*w)``, R the learning-rate input, so schedules
scale the decay as torch does); ``post_weight_decay = lr*w`` only approximates it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from ..errors import TrainingOpError


def _real(cls: str, name: str, value) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None or np.ndim(value) != 0:
        raise TrainingOpError(f"{cls}: {name} must be a real number, found {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TrainingOpError(f"{cls}: {name} must be a real number, found {value!r}") from None


def _check_finite(cls: str, **values: float) -> None:
    for name, value in values.items():
        if not np.isfinite(_real(cls, name, value)):
            raise TrainingOpError(f"{cls}: {name} must be finite, found {value!r}")


def _check_nonnegative(cls: str, **values: float) -> None:
    for name, value in values.items():
        number = _real(cls, name, value)
        if not (np.isfinite(number) and number >= 0.0):
            raise TrainingOpError(f"{cls}: {name} must be finite and >= 0, found {value!r}")


@dataclass(frozen=True)
class Adam:
    """Adam as ``torch.optim.Adam`` spells it (defaults from torch); ONNX op ``Adam``.

    ``eps`` is added to ``sqrt(H)`` before the bias correction (TensorFlow's form), see the
    module doc; torch and this op agree exactly when ``eps == 0``.

    Args:
        lr: learning rate (the base rate of the model's learning-rate input).
        betas: ``(beta1, beta2)``, ONNX's ``alpha`` and ``beta``, each in [0, 1).
        eps: ONNX's ``epsilon``, added to ``sqrt(H)``.
        weight_decay: L2 penalty added to the gradient (ONNX's ``norm_coefficient``).
        post_weight_decay: ONNX's ``norm_coefficient_post``, ``X <- (1 - c) * X_new`` after the
            update, not scaled by the learning rate.

    Raises:
        TrainingOpError: a value out of range (negative, not finite, betas not in [0, 1)).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    post_weight_decay: float = 0.0

    op_type: ClassVar[str] = "Adam"
    states: ClassVar[tuple[str, ...]] = ("V", "H")
    t_offset: ClassVar[int] = 1  # the op receives T + 1: bias correction from the first step

    def __post_init__(self):
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
                not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                        for b in betas):
            raise TrainingOpError(f"Adam: betas must be two numbers in [0, 1) (as torch's "
                                  f"(0.9, 0.999)), found {betas!r}")
        _check_nonnegative("Adam", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
                           post_weight_decay=self.post_weight_decay)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))

    @property
    def decoupled_weight_decay(self) -> float:
        """The weight decay applied before the op as ``X * (1 - R*w)`` (:class:`AdamW`); 0 here."""
        return 0.0

    def attributes(self) -> dict[str, float | str]:
        return {
            "alpha": float(self.betas[0]),
            "beta": float(self.betas[1]),
            "epsilon": float(self.eps),
            "norm_coefficient": float(self.weight_decay),
            "norm_coefficient_post": float(self.post_weight_decay),
        }

    def initial_value(self, state: str) -> float:
        return 0.0


@dataclass(frozen=True)
class AdamW(Adam):
    """``torch.optim.AdamW``: decoupled weight decay ``X <- X * (1 - lr*weight_decay)`` before the Adam update.

    The decay is emitted as standard ONNX ops before the ``Adam`` node, whose own
    ``norm_coefficient`` stays 0; the learning rate scales it, so schedules do too.

    Args:
        lr: learning rate.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: ONNX's ``epsilon``, added to ``sqrt(H)``.
        weight_decay: decoupled weight decay (default 1e-2, as torch's).
        post_weight_decay: ONNX's ``norm_coefficient_post`` (see :class:`Adam`).

    Raises:
        TrainingOpError: a value out of range.
    """

    weight_decay: float = 1e-2

    @property
    def decoupled_weight_decay(self) -> float:
        return float(self.weight_decay)

    def attributes(self) -> dict[str, float | str]:
        return {**super().attributes(), "norm_coefficient": 0.0}


@dataclass(frozen=True)
class Momentum:
    """SGD with momentum as ``torch.optim.SGD`` spells it; ONNX op ``Momentum``.

    ``momentum=0`` is plain SGD.

    Args:
        lr: learning rate.
        momentum: ONNX's ``alpha``.
        dampening: ``1 - dampening`` is ONNX's ``beta``.
        nesterov: ONNX's ``mode``: ``"nesterov"`` if True, else ``"standard"``.
        weight_decay: L2 penalty added to the gradient (ONNX's ``norm_coefficient``).

    Raises:
        TrainingOpError: a value out of range.
    """

    lr: float = 1e-2
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    op_type: ClassVar[str] = "Momentum"
    states: ClassVar[tuple[str, ...]] = ("V",)
    t_offset: ClassVar[int] = 0

    def __post_init__(self):
        _check_nonnegative("Momentum", lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        _check_finite("Momentum", dampening=self.dampening)
        if not isinstance(self.nesterov, (bool, np.bool_)):
            raise TrainingOpError(f"Momentum: nesterov must be True or False, found {self.nesterov!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise TrainingOpError("Momentum: nesterov requires momentum > 0 and dampening == 0 (as in torch)")

    @property
    def decoupled_weight_decay(self) -> float:
        return 0.0

    def attributes(self) -> dict[str, float | str]:
        return {
            "alpha": float(self.momentum),
            "beta": float(1.0 - self.dampening),
            "mode": "nesterov" if self.nesterov else "standard",
            "norm_coefficient": float(self.weight_decay),
        }

    def initial_value(self, state: str) -> float:
        return 0.0


@dataclass(frozen=True)
class Adagrad:
    """Adagrad as ``torch.optim.Adagrad`` spells it (defaults from torch); ONNX op ``Adagrad``.

    Args:
        lr: learning rate.
        lr_decay: ONNX's ``decay_factor``.
        eps: ONNX's ``epsilon``.
        weight_decay: L2 penalty added to the gradient (ONNX's ``norm_coefficient``).
        initial_accumulator_value: the initial value of the state H.

    Raises:
        TrainingOpError: a value out of range.
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    op_type: ClassVar[str] = "Adagrad"
    states: ClassVar[tuple[str, ...]] = ("H",)
    t_offset: ClassVar[int] = 0

    def __post_init__(self):
        _check_nonnegative("Adagrad", lr=self.lr, lr_decay=self.lr_decay, eps=self.eps,
                           weight_decay=self.weight_decay, initial_accumulator_value=self.initial_accumulator_value)

    @property
    def decoupled_weight_decay(self) -> float:
        return 0.0

    def attributes(self) -> dict[str, float | str]:
        return {
            "decay_factor": float(self.lr_decay),
            "epsilon": float(self.eps),
            "norm_coefficient": float(self.weight_decay),
        }

    def initial_value(self, state: str) -> float:
        return float(self.initial_accumulator_value)


Optimizer = Adam | AdamW | Momentum | Adagrad
OPTIMIZER_CLASSES = {"Adam": Adam, "AdamW": AdamW, "Momentum": Momentum, "Adagrad": Adagrad}


def to_json(optimizer: Optimizer) -> str:
    """``{"type": "Adam", "lr": ..., ...}``: how the builder records the optimizer in the model's metadata."""
    return json.dumps({"type": type(optimizer).__name__, **asdict(optimizer)})


def from_json(text: str) -> Optimizer:
    data = json.loads(text)
    cls = OPTIMIZER_CLASSES[data.pop("type")]
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    return cls(**data)
