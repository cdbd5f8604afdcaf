"""Optional dependencies of a command: a missing one is a one-line hint (exit status 2), never a traceback."""

from __future__ import annotations

import importlib.util


class MissingExtra(Exception):
    """A command needs an optional dependency that is not installed."""


def require(module: str, extra: str) -> None:
    """Raise :class:`MissingExtra` naming the extra to install when ``module`` is missing.

    Args:
        module: the importable module (``"tqdm"``).
        extra: the package extra that installs it (``"demo"``).

    Raises:
        MissingExtra: the module is not installed.
    """
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"this command needs {module!r}: pip install 'onnx-training-ops[{extra}]'")
