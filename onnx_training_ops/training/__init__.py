"""Training sessions: run ONNX training models (``training_info``) in stock onnxruntime.

* :mod:`.session` — :class:`TrainingSession`, the public API: a thin class over the engine
  (:mod:`.engine`): its state store, programs, loop (learning rates with :mod:`.rates`) and
  checkpointer, and its two strategies (where the state lives, where the update runs); with
  :mod:`.options`, :mod:`.checks` (labels, properties);
* :mod:`.schedules` — learning-rate schedules with torch's names;
* :mod:`.program` — one TrainingInfoProto's algorithm as the graph onnxruntime runs, its
  frozen :class:`~.program.Analysis` and the open :class:`~.program.Program`;
* :mod:`.in_place_updates` — what a step applies to the state itself (cut optimizer nodes,
  lazy table rows, RMSProp), reading values whose origins :mod:`.sources` names;
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
