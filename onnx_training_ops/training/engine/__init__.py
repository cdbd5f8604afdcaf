"""The training engine: one state store, one set of programs, one loop, one accumulation.

``TrainingSession`` (:mod:`..session`) is a thin class over the four parts
:func:`~.open.open_parts` opens in order: :class:`~.store.StateStore` (the state variables),
:class:`~.programs.SessionPrograms` (the onnxruntime programs over them),
:class:`~.loop.TrainingLoop` (steps, evaluation, accumulation with :mod:`.accumulation`,
learning rates) and :class:`~.files.Checkpointer` (checkpoints, exports, properties).

Two strategies, chosen once when the session opens (:mod:`.config`), not class trees:

* **where the state lives** (:mod:`.memory`, the :class:`~.memory.StateMemory` protocol): host
  arrays bound zero-copy (:class:`~.memory.HostMemory`: the default session and
  ``device="cpu"``; ``state_views``, ``gradient_buffers`` and ``get_flat_parameters(copy=False)``
  hand out live views), or OrtValues on a device (:class:`~.memory.DeviceMemory`);
* **where the update runs** (:mod:`.protocols`, the :class:`~.protocols.UpdateStrategy`
  protocol opening :class:`~.protocols.EngineProgram` s): after onnxruntime's run by the fused
  kernels, or during it by the native kernels with ``fast=False`` (:class:`~.fused.FusedUpdate`,
  host arrays only), or lowered to standard ops in the graph (:class:`~.graph.GraphUpdate`:
  guarded ``Where``, in place when safe else two sets, CUDA graphs at fixed addresses).

The accumulated gradients are one flat buffer per dtype in either memory
(:attr:`~.accumulation.GradientAccumulation.flat`): what a collective all-reduces, in place,
through DLPack (``TrainingSession.gradient_tensors``).
"""

from .config import RuntimeConfig, checked_config
from .open import check_threads, open_parts

__all__ = ["RuntimeConfig", "check_threads", "checked_config", "open_parts"]
