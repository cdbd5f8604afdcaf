"""Numpy reference kernels of the training domain's optimizers: the oracle every faster path is tested against.

``adam(r, t, *tensors, **attributes)`` (likewise ``momentum``, ``adagrad``) take the op's
inputs in the op's order and return its outputs in the op's order. They live with each
optimizer's other forms in :mod:`onnx_training_ops.optim`; this package holds the loops that
compile their elements (``fused``: numba in place; ``_native_kernels``: onnxruntime cfuncs).

May import: errors, schema, optim.
"""

from ..optim.adagrad import adagrad
from ..optim.adam import adam
from ..optim.momentum import momentum

REFERENCE_KERNELS = {"Adam": adam, "Momentum": momentum, "Adagrad": adagrad}

__all__ = ["adam", "momentum", "adagrad", "REFERENCE_KERNELS"]
