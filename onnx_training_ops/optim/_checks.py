"""Checks of the descriptions' hyper-parameters: a clear TrainingOpError naming the field."""

from __future__ import annotations

import numpy as np

from ..errors import TrainingOpError


def _real(cls: str, name: str, value) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None or np.ndim(value) != 0:
        raise TrainingOpError(f"{cls}: {name} must be a real number, found {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TrainingOpError(f"{cls}: {name} must be a real number, found {value!r}") from None


def check_finite(cls: str, **values: float) -> None:
    """Raise TrainingOpError unless every value is a finite real number."""
    for name, value in values.items():
        if not np.isfinite(_real(cls, name, value)):
            raise TrainingOpError(f"{cls}: {name} must be finite, found {value!r}")


def check_nonnegative(cls: str, **values: float) -> None:
    """Raise TrainingOpError unless every value is a finite real number >= 0."""
    for name, value in values.items():
        number = _real(cls, name, value)
        if not (np.isfinite(number) and number >= 0.0):
            raise TrainingOpError(f"{cls}: {name} must be finite and >= 0, found {value!r}")


def check_betas(cls: str, betas, example: str = "") -> tuple[float, float]:
    """``betas`` as two floats in [0, 1); raises TrainingOpError naming ``cls`` otherwise."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
            not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas):
        raise TrainingOpError(f"{cls}: betas must be two numbers in [0, 1){example}, found {betas!r}")
    return float(betas[0]), float(betas[1])


def check_bool(cls: str, name: str, value) -> None:
    """Raise TrainingOpError unless ``value`` is True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise TrainingOpError(f"{cls}: {name} must be True or False, found {value!r}")
