"""Reverse-mode differentiation of ONNX graphs, emitted as ordinary ONNX ops.

``graph.backprop`` walks from ``y`` back to the differentiated values and asks the rule of
each op (registered in ``rules_*.py``) for the gradients of its inputs. Used by
:mod:`onnx_training_ops.passes.expand_gradient` to expand the ``Gradient`` op.
"""

from __future__ import annotations

from . import (  # noqa: F401
    rules_activation,
    rules_attention,
    rules_conv,
    rules_elementwise,
    rules_indexing,
    rules_linalg,
    rules_loss,
    rules_nn,
    rules_norm,
    rules_quantized,
    rules_reduce,
    rules_resize,
    rules_shape,
    rules_slicing,
)
from .emitter import Emitter, ValueMeta
from .graph import backprop, topological_sort
from .registry import RULES, RuleContext, RuleError, register, supported_ops

__all__ = ["Emitter", "ValueMeta", "backprop", "topological_sort", "RULES", "RuleContext",
           "RuleError", "register", "supported_ops"]
