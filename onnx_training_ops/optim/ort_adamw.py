"""onnxruntime-training's AdamW (``OrtAdamW``), operation for operation, in standard ONNX ops.

onnxruntime-training's optimizer model is one ``com.microsoft::AdamWOptimizer`` node; its CPU
kernel (``orttraining/training_ops/cpu/optimizer/adamw/adamw.cc``) computes in float32, with
float32 attributes ``alpha`` (beta1), ``beta`` (beta2), ``epsilon``, ``weight_decay``, and
``step`` = the number of updates done + 1 (the on-device Optimizer feeds ``step + 1``)::

    alpha_correction = 1 - float(pow(double(alpha), step))      # 1 without correct_bias
    beta_correction  = 1 - float(pow(double(beta), step))
    m1 = alpha * m1 + (1 - alpha) * g
    m2 = beta * m2 + ((1 - beta) * g) * g
    adam_mode 1 (transformers; what generate_artifacts writes):
        lr_corrected = lr * (sqrt(beta_correction) / alpha_correction)
        w = w - (lr_corrected * m1) / (sqrt(m2) + epsilon)
        w = w - (lr * weight_decay) * w
    adam_mode 0 (torch; needs correct_bias):
        w = w - (w * lr) * weight_decay
        w = w - (lr * m1) / (alpha_correction * (sqrt(m2 / beta_correction) + epsilon))

Our ``Adam`` op cannot express this exactly (its decay is ``(1 - c) * X`` with a constant c, and
its bias correction is not rounded the same way), so :func:`emit_update` writes the formula above
with standard ops in this order and dtype, as RMSProp is written (``tests/test_migrate_adamw.py``
replays onnxruntime-training's own gradients through it and gets its parameters bit for bit).
The bias corrections are computed once per call from the step T + 1 (``t_offset = 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from onnx import TensorProto

from ..errors import TrainingOpError
from ._checks import check_betas, check_bool, check_nonnegative
from .base import Defaults

if TYPE_CHECKING:
    from .base import Ops


@dataclass(frozen=True)
class OrtAdamW(Defaults):
    """onnxruntime-training's ``AdamWOptimizer``: its attributes with torch's names, as standard ops.

    Defaults are onnxblock's ``AdamW()`` (what ``generate_artifacts(..., OptimType.AdamW)``
    writes). float32 parameters only, as the kernel.

    Args:
        lr: the on-device Optimizer's default learning rate.
        betas: ``(alpha, beta)``, the moments' decays.
        eps: ``epsilon``.
        weight_decay: the decoupled weight decay.
        mode: ``adam_mode``: 1 transformers' AdamW, 0 torch's.
        bias_correction: ``correct_bias``.

    Raises:
        TrainingOpError: a value out of range.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    mode: int = 1
    bias_correction: bool = True

    # op_type "": no op of the training domain, standard ops (emit_update); the decay is
    # part of emit_update, not the builder's X * (1 - R*w) (decoupled_weight_decay 0)
    states: ClassVar[tuple[str, ...]] = ("V", "H")  # first and second moment (momentum0/1)
    t_offset: ClassVar[int] = 1  # the kernel's step: updates done + 1

    def __post_init__(self):
        betas = check_betas("OrtAdamW", self.betas)
        check_nonnegative("OrtAdamW", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self.mode not in (0, 1) or isinstance(self.mode, bool):
            raise TrainingOpError(f"OrtAdamW: mode (adam_mode) must be 0 or 1, found {self.mode!r}")
        check_bool("OrtAdamW", "bias_correction", self.bias_correction)
        if self.mode == 0 and not self.bias_correction:
            raise TrainingOpError("OrtAdamW: mode 0 (torch's AdamW) requires bias_correction=True, "
                                  "as onnxruntime-training's kernel does")
        object.__setattr__(self, "betas", betas)


def _f32(value: float) -> np.ndarray:
    return np.array(value, np.float32)


def _corrections(ops: Ops, opt: OrtAdamW, t: str) -> tuple[str, str]:
    """(alpha_correction, beta_correction): ``1 - float(pow(double(b), step))`` each."""
    step = ops.op("Cast", [t], to=TensorProto.DOUBLE)
    out = []
    for b in opt.betas:
        power = ops.op("Pow", [ops.const(np.array(np.float32(b), np.float64)), step])
        out.append(ops.op("Sub", [ops.const(_f32(1.0)), ops.op("Cast", [power], to=TensorProto.FLOAT)]))
    return out[0], out[1]


def emit_update(ops: Ops, opt: OrtAdamW, r: str, t: str, xs: Sequence[str], gs: Sequence[str],
                states: dict[str, list[str]], new_xs: Sequence[str],
                new_states: dict[str, list[str]], dtypes: Sequence[np.dtype]) -> None:
    """One AdamW step of tensors ``xs`` (see the module docstring); ``r`` float, ``t`` = step."""
    for x, dtype in zip(xs, dtypes):
        if np.dtype(dtype) != np.float32:
            raise TrainingOpError(f"OrtAdamW: parameter {x!r} is {np.dtype(dtype)}; onnxruntime-"
                                  "training's AdamW kernel (and so this optimizer) is float32 only")
    alpha, beta = (np.float32(b) for b in opt.betas)
    c_alpha, c_one_alpha = ops.const(_f32(alpha)), ops.const(_f32(np.float32(1) - alpha))
    c_beta, c_one_beta = ops.const(_f32(beta)), ops.const(_f32(np.float32(1) - beta))
    c_eps, c_wd = ops.const(_f32(opt.eps)), ops.const(_f32(opt.weight_decay))
    if opt.bias_correction:
        a_corr, b_corr = _corrections(ops, opt, t)
    lr_corrected = r
    if opt.mode == 1 and opt.bias_correction:
        lr_corrected = ops.op("Mul", [r, ops.op("Div", [ops.op("Sqrt", [b_corr]), a_corr])])
    lr_wd = ops.op("Mul", [r, c_wd]) if opt.mode == 1 and opt.weight_decay else None
    for i, (x, g) in enumerate(zip(xs, gs)):
        m1, m2 = states["V"][i], states["H"][i]
        m1_new, m2_new = new_states["V"][i], new_states["H"][i]
        ops.op("Add", [ops.op("Mul", [c_alpha, m1]), ops.op("Mul", [c_one_alpha, g])], out=m1_new)
        ops.op("Add", [ops.op("Mul", [c_beta, m2]), ops.op("Mul", [ops.op("Mul", [c_one_beta, g]), g])],
               out=m2_new)
        if opt.mode == 1:
            denom = ops.op("Add", [ops.op("Sqrt", [m2_new]), c_eps])
            step = ops.op("Div", [ops.op("Mul", [lr_corrected, m1_new]), denom])
            if lr_wd is None:
                ops.op("Sub", [x, step], out=new_xs[i])
            else:
                updated = ops.op("Sub", [x, step])
                ops.op("Sub", [updated, ops.op("Mul", [lr_wd, updated])], out=new_xs[i])
        else:
            decayed = ops.op("Sub", [x, ops.op("Mul", [ops.op("Mul", [x, r]), c_wd])])
            denom = ops.op("Add", [ops.op("Sqrt", [ops.op("Div", [m2_new, b_corr])]), c_eps])
            step = ops.op("Div", [ops.op("Mul", [r, m1_new]), ops.op("Mul", [a_corr, denom])])
            ops.op("Sub", [decayed, step], out=new_xs[i])

