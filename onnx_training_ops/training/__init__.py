"""Training sessions: run ONNX training models (``training_info``) in stock onnxruntime.

* :mod:`.session` — :class:`TrainingSession`, the public API, in parts: :mod:`.session_state`
  (state variables), :mod:`.session_loop` (evaluate, backward/optimizer_step, schedules),
  :mod:`.session_files` (checkpoints, exports); with :mod:`.accumulation` (the gradient
  accumulators), :mod:`.rates` (learning rates and the schedule), :mod:`.options`,
  :mod:`.checks` (labels, properties);
* :mod:`.schedules` — learning-rate schedules with torch's names;
* :mod:`.program` — one TrainingInfoProto's algorithm as the graph onnxruntime runs;
* :mod:`.fast_path` — optimizer nodes applied in place by the fused kernels;
* :mod:`.binding` — the zero-copy IOBinding of state and buffers;
* :mod:`.step` — one step: feeds, run, non-finite check, state update;
* :mod:`.stages` — the model cut at its Gradient node (backward, apply, evaluation);
* :mod:`.in_place`, :mod:`.row_updates`, :mod:`.rmsprop_fast_path`, :mod:`.shard` — in-place
  optimizers, lazy table rows, fused RMSProp, ZeRO-1's per-rank model;
* :mod:`.feeds`, :mod:`.state`, :mod:`.inference`, :mod:`.from_graph` — the rest.

May import: errors, schema, interrupts, walk, storage, kernels, passes, runtime, builder.
"""

from . import schedules
from .from_graph import graph_to_training_model
from .session import NONFINITE_POLICIES, NonFiniteLossError, TrainingSession

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession", "graph_to_training_model", "schedules"]
