"""One line on stderr when numba really compiles the package's kernels (not a cache load).

The first session after an install compiles the fused and native kernels (tens of seconds
on a slow machine) and stores them in numba's disk cache; later processes load them in
about a second. :func:`announce_compiles` says so while it happens, once per process, and
stays silent when everything comes from the cache: it listens to numba's ``numba:run_pass``
event, which fires only for compiler passes, never for a cache load. Session creation runs
under it, and so does the first call of a session's ``step``/``evaluate``/``backward``/
``optimizer_step`` (:func:`announced_on_first_call`): kernels compiled lazily on first use
(the label check, a parallel variant) are announced too, and later calls pay nothing.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, TypeVar

MESSAGE = "onnx-training-ops: compiling the kernels this model uses (first run only, then cached)..."
_announced = False
_lock = threading.Lock()
_S = TypeVar("_S")  # the object a decorated method is bound to
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _announce() -> None:
    global _announced
    with _lock:
        if _announced:
            return
        _announced = True
    print(MESSAGE, file=sys.stderr, flush=True)


@contextlib.contextmanager
def announce_compiles() -> Iterator[None]:
    """Within the block: the first numba compile of the process prints :data:`MESSAGE`."""
    if _announced:
        yield
        return
    try:
        from numba.core import event
    except ImportError:  # pragma: no cover - numba's event API moved: stay silent
        yield
        return

    class _Listener(event.Listener):
        def on_start(self, _event) -> None:
            _announce()

        def on_end(self, _event) -> None:
            pass

    listener = _Listener()
    event.register("numba:run_pass", listener)
    try:
        yield
    finally:
        event.unregister("numba:run_pass", listener)


def announced_on_first_call(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Decorate a method so that its first call on each object runs under
    :func:`announce_compiles` (a session's first step may compile the kernels it uses first).

    Args:
        method: the method; later calls (or any call once the process has announced) run it as is.

    Returns:
        The wrapped method.
    """
    seen: weakref.WeakSet = weakref.WeakSet()

    @functools.wraps(method)
    def wrapper(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if _announced or self in seen:
            return method(self, *args, **kwargs)
        seen.add(self)
        with announce_compiles():
            return method(self, *args, **kwargs)

    return wrapper
