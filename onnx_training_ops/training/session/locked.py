"""One lock per session: a shared TrainingSession runs one call at a time."""

from __future__ import annotations

import functools


def locked(method):
    """Run ``method`` holding ``self._lock`` (an RLock made by the session)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper
