"""The progress of ``train``: tqdm's bar when tqdm is installed (the ``cli`` extra), else plain lines
on stderr, so that a plain install trains too."""

from __future__ import annotations

import importlib.util
import sys
import time


class Lines:
    """What ``train`` asks of tqdm, without it: a terminal gets one line redrawn a few times a
    second, a log file one line per epoch (carriage-return redraws would pile up there)."""

    def __init__(self, total: int, desc: str, stream=None) -> None:
        self.total, self.desc, self.done, self.postfix = total, desc, 0, ""
        self.stream = stream if stream is not None else sys.stderr
        self.redraw = self.stream.isatty()
        self.last = 0.0

    def _line(self) -> str:
        return f"{self.desc}: {self.done}/{self.total} steps" + (f", {self.postfix}" if self.postfix else "")

    def _draw(self) -> None:
        self.stream.write("\r" + self._line() + "\x1b[K")
        self.stream.flush()
        self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.redraw and time.monotonic() - self.last > 0.2:
            self._draw()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())
        if self.redraw:
            self._draw()
        else:
            print(self._line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.redraw:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


def progress_bar(total: int, desc: str):
    """tqdm's bar over ``total`` steps when tqdm is installed, else :class:`Lines`."""
    if importlib.util.find_spec("tqdm") is None:
        return Lines(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, unit="step", desc=desc)
