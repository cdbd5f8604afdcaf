"""One line on stderr when numba really compiles the package's kernels (not a cache load).

The first session after an install compiles the fused and native kernels (tens of seconds
on a slow machine) and stores them in numba's disk cache; later processes load them in
about a second. :func:`announce_compiles` says so while it happens, once per process, and
stays silent when everything comes from the cache: it listens to numba's ``numba:run_pass``
event, which fires only for compiler passes, never for a cache load.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

MESSAGE = "onnx-training-ops: compiling optimizer kernels (first run only, cached)..."
_announced = False
_lock = threading.Lock()


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
