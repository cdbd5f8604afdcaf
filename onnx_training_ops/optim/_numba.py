"""How the per-element arithmetic is compiled: numba, inlined into every loop that calls it.

``element`` functions are ``numba.njit(inline="always")``: each loop of
:mod:`onnx_training_ops.kernels._numba_kernels`, ``_numba_rows``, ``_numba_rmsprop`` and
``_native_kernels`` gets the same IR as a written-out body. ``fastmath=False`` keeps LLVM from
contracting into FMAs or reassociating, so results match numpy bit for bit.

``scalar`` functions (the scalar preparation) stay plain Python functions, called as such by
the reference and the fused kernels' callers, and compile inline where a numba function calls
them (the native kernels: ``numba.extending.register_jitable``).

A cached caller in another file is not invalidated when these change: clear
``__pycache__/*.nbi`` after editing an element or a scalar function.
"""

from __future__ import annotations

from numba import njit
from numba.extending import register_jitable

OPTIONS = dict(fastmath=False, error_model="numpy", boundscheck=False)

element = njit(inline="always", **OPTIONS)
scalar = register_jitable
