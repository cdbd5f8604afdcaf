"""Training sessions: run ONNX training models (``training_info``) in stock onnxruntime.

Sub-packages, top down (each ``__init__`` says what it holds):

* :mod:`.session` — :class:`TrainingSession`, the public API: a thin class over the engine;
* :mod:`.engine` — one state store, one set of programs, one loop, one accumulation, and the two
  strategies chosen at open (where the state lives, where the update runs);
* :mod:`.options` — what a session is opened with: SessionOptions, providers and device, mixed
  precision, learning rates;
* :mod:`.inputs` — what a step is fed, checked before onnxruntime runs;
* :mod:`.graphs` — the graphs onnxruntime runs (program, stages, inference, static shapes) and one
  step of them (binding, step);
* :mod:`.fastpath` — updates written into the state in place (fused kernels, lazy rows, RMSProp,
  loss-scaled steps, ``fast=False``'s native kernels);
* :mod:`.state.state` — state variables, nominal checkpoints, flat parameters, ZeRO-1 shards, the
  data-parallel fingerprint, torch names;

with :mod:`.summary` (``summary()`` of a model or a session) and :mod:`.arrays` (numpy helpers).
Learning-rate schedules are :mod:`onnx_training_ops.schedules`.

May import: errors, schema, interrupts, walk, storage, optim, schedules, kernels, passes, runtime, lora,
builder.
"""

from .session.from_graph import graph_to_training_model
from .session.session import NONFINITE_POLICIES, NonFiniteLossError, TrainingSession

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession", "graph_to_training_model"]
