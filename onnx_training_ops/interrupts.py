"""Ctrl-C held back while a run or a state write is under way: ``with held_interrupts(): ...``.

Python runs signal handlers in the main thread, between bytecodes, whichever thread the
signal reached. A signal mask therefore does not hold Ctrl-C back once other threads exist
(onnxruntime's thread pools do): the kernel hands SIGINT to one of them and
KeyboardInterrupt still surfaces in the main thread, at any line. What holds it back is the
Python-level handler. The first time a section is entered in the main thread while Python's
default handler is in place, that handler is replaced, once for the process, by
:func:`sigint`, which does the same (raise KeyboardInterrupt) outside held sections and
only takes note inside one; the outermost section raises KeyboardInterrupt as it ends.
Entering a section then costs well under a microsecond (swapping handlers per section
costs about 5). A handler the program installed itself is swapped for the section and
called at its end; under ``SIG_DFL`` the signal is sent again at the end; ``SIG_IGN``
needs nothing, and a handler installed outside Python is left alone. Other threads need
nothing either: KeyboardInterrupt is never raised there.

A Ctrl-C that arrives before a section starts raises before it, as usual.
"""

from __future__ import annotations

import _signal  # signal.getsignal wraps it in an enum conversion: 10x slower
import os
import signal
import threading

_SIGINT = signal.SIGINT
_MAIN_THREAD = threading.main_thread().ident
_get_ident, _getsignal, _IGNORE = threading.get_ident, _signal.getsignal, _signal.SIG_IGN


class _Held:
    depth = 0  # main-thread sections open
    noted = False  # a Ctrl-C arrived inside one


def sigint(signum, frame) -> None:
    """``signal.default_int_handler``, except inside held sections: there it takes note."""
    if _Held.depth:
        _Held.noted = True
    else:
        signal.default_int_handler(signum, frame)


class held_interrupts:
    """Hold Ctrl-C (SIGINT) for the section; one that arrived is raised as it ends."""

    __slots__ = ("previous", "main")

    def __enter__(self) -> None:
        self.previous = None
        self.main = _get_ident() == _MAIN_THREAD
        if not self.main:
            return
        handler = _getsignal(_SIGINT)
        if handler is not sigint and handler is not None and handler != _IGNORE:
            signal.signal(_SIGINT, sigint)
            if handler is not signal.default_int_handler:
                self.previous = handler  # the program's own: put back when the section ends
        _Held.depth += 1

    def __exit__(self, *exc) -> None:
        if not self.main:
            return
        _Held.depth -= 1
        previous = self.previous
        if previous is not None:
            signal.signal(_SIGINT, previous)
        if _Held.depth or not _Held.noted:
            return
        _Held.noted = False
        if previous is None:
            raise KeyboardInterrupt
        if callable(previous):
            previous(_SIGINT, None)
        else:  # SIG_DFL: what it would have done, now
            os.kill(os.getpid(), _SIGINT)
