"""The onnxruntime wiring: kernels registered with onnxruntime-extensions, ``prepare``, sessions.

* :mod:`.extensions` — loads onnxruntime-extensions' PyOp module and library, never its
  package ``__init__`` (which imports torch);
* :mod:`.plugin` — the Python (PyOp) kernels and their invocation hook;
* :mod:`.native` — the numba ``cfunc`` kernels as ``OrtCustomOp`` structs (zero-copy);
* :mod:`.options` — :func:`session_options` and the choice of kernel path (:func:`select_kernels`);
* :mod:`.pipeline` — :func:`prepare`: a pass pipeline of :mod:`..passes` for the chosen path;
* :mod:`.session` — :class:`InferenceSession`, ``onnxruntime.InferenceSession`` that prepares first;
* :mod:`.kernel_table` — onnxruntime's CUDA EP kernels at their types: which nodes of a graph it
  would run on the CPU (:func:`~.kernel_table.cpu_nodes`), which Concat/Split upload a table per run.

May import: errors, schema, interrupts, walk, storage, optim, kernels, passes.
"""

from .options import session_options
from .pipeline import prepare
from .session import InferenceSession

__all__ = ["InferenceSession", "prepare", "session_options"]
