"""The optimizers, one module each: reference math, scalars, element, description, lowering.

:mod:`.adam` (Adam, AdamW), :mod:`.momentum` (torch's SGD), :mod:`.adagrad`, :mod:`.rmsprop`,
:mod:`.ort_adamw` (onnxruntime-training's AdamW); :mod:`.registry` lists them all, and
:class:`.base.Optimizer` is the contract of a description. The kernels
(:mod:`onnx_training_ops.kernels`) compile the elements into their loops; the builder reads
the descriptions; ``passes.lower_optimizers`` calls the lowerings. Each description is a small
frozen dataclass with torch's hyper-parameter names (``onnx_training_ops.Adam`` and the others
are these classes).

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

Adam's epsilon and AdamW's decay: :mod:`.adam`.
"""
