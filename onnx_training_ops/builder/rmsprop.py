"""RMSProp as ``torch.optim.RMSprop`` spells it: now in :mod:`onnx_training_ops.optim.rmsprop`
(the description, its standard-op update and its fused element); kept for old imports."""

from ..optim.rmsprop import RMSProp, emit_rmsprop

__all__ = ["RMSProp", "emit_rmsprop"]
