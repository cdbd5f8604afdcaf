"""How the per-element arithmetic is compiled: numba, inlined into every loop that calls it.

``element`` functions are ``numba.njit(inline="always")``: each loop of
:mod:`onnx_training_ops.kernels._numba_kernels`, ``_numba_rows``, ``_numba_rmsprop`` and
``_native_kernels`` gets the same IR as a written-out body. ``fastmath=False`` keeps LLVM from
contracting into FMAs or reassociating, so results match numpy bit for bit.

``scalar`` functions (the scalar preparation) stay plain Python functions, called as such by
the reference and the fused kernels' callers, and compile inline where a numba function calls
them (the native kernels: ``numba.extending.register_jitable``).

The loops that inline them live in other files, and numba keys a cached function by its own
file: :func:`cache_covers_inlined_sources` widens the key of every kernel's cache to these
sources, so editing an element recompiles the loops.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, TypedDict


class JitOptions(TypedDict, total=False):
    """Keywords of ``numba.njit`` / ``cfunc`` as the kernels pass them (``njit(**OPTIONS)``)."""

    nogil: bool
    cache: bool
    parallel: bool
    fastmath: bool | set[str]
    error_model: Literal["python", "numpy"]
    boundscheck: bool


OPTIONS: JitOptions = {"fastmath": False, "error_model": "numpy", "boundscheck": False}

try:
    from numba import njit
    from numba.extending import register_jitable
except ImportError:  # pragma: no cover - numba is a dependency; the references work without it
    element = scalar = lambda func: func
else:
    element = njit(inline="always", **OPTIONS)
    scalar = register_jitable


# ---- the disk cache of the loops that inline these functions ----
#
# numba keys a cached function by its own source file only, so a loop in kernels/ would keep
# its compiled code when an element here changes. The locator below wraps numba's own for
# every function of onnx_training_ops/kernels/: its stamp also covers the sources the loops
# inline (this package and the kernels' private modules), so an edit there recompiles them.

_OPTIM = Path(__file__).resolve().parent
_KERNELS = _OPTIM.parent / "kernels"


@lru_cache(maxsize=1)
def _inlined_sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted([*_OPTIM.glob("*.py"), *_KERNELS.glob("_*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class _InlinedSourcesLocator:
    """numba's locator for a kernel function, its source stamp widened to what it inlines."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def get_source_stamp(self):
        return self._inner.get_source_stamp(), _inlined_sources_hash()

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            if Path(py_file).resolve().parent != _KERNELS:
                return None
        except OSError:
            return None
        for other in _locator_classes():
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None


def _locator_classes() -> list[Any]:
    """numba's cache locator classes, in the order it tries them (duck-typed: ``from_function``)."""
    try:
        from numba.core.caching import CacheImpl
    except ImportError:  # numba < 0.68 names it _CacheImpl
        from numba.core.caching import _CacheImpl as CacheImpl  # type: ignore[attr-defined, no-redef]
    return CacheImpl._locator_classes


def cache_covers_inlined_sources() -> None:
    """Put :class:`_InlinedSourcesLocator` first in numba's locator chain (once per process).
    Call it before defining a cached function that inlines elements or scalar functions."""
    classes = _locator_classes()
    if _InlinedSourcesLocator not in classes:
        classes.insert(0, _InlinedSourcesLocator)
