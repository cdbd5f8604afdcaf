"""The onnxruntime wiring: kernels registered with onnxruntime-extensions, ``prepare``, sessions.

* :mod:`.extensions` — loads onnxruntime-extensions' PyOp module and library, never its
  package ``__init__`` (which imports torch);
* :mod:`.plugin` — the Python (PyOp) kernels and their invocation hook;
* :mod:`.native` — the numba ``cfunc`` kernels as ``OrtCustomOp`` structs (zero-copy);
* :mod:`.options` — :func:`session_options` and the choice of kernel path (:func:`select_kernels`);
* :mod:`.pipeline` — :func:`prepare`: a pass pipeline of :mod:`..passes` for the chosen path;
* :mod:`.session` — :class:`InferenceSession`, ``onnxruntime.InferenceSession`` that prepares first.

May import: errors, schema, interrupts, walk, storage, optim, kernels, passes.
"""

from .options import session_options
from .pipeline import prepare
from .session import InferenceSession

__all__ = ["InferenceSession", "prepare", "session_options"]
