"""Compatibility shim: the training session lives in :mod:`onnx_training_ops.training`."""

from .training import NONFINITE_POLICIES, NonFiniteLossError, TrainingSession, graph_to_training_model

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession", "graph_to_training_model"]
