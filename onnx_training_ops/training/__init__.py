"""Training sessions: run ONNX training models (``training_info``) in stock onnxruntime.

* :mod:`.session` — :class:`TrainingSession`, the public API;
* :mod:`.program` — one TrainingInfoProto's algorithm as the graph onnxruntime runs;
* :mod:`.fast_path` — optimizer nodes applied in place by the fused kernels;
* :mod:`.binding` — the zero-copy IOBinding of state and buffers;
* :mod:`.step` — one step: feeds, run, non-finite check, state update;
* :mod:`.feeds`, :mod:`.state`, :mod:`.inference`, :mod:`.from_graph` — the rest.
"""

from .from_graph import graph_to_training_model
from .session import NONFINITE_POLICIES, NonFiniteLossError, TrainingSession

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession", "graph_to_training_model"]
