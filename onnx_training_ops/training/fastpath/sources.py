"""Where an input of an update applied in place (cut optimizer node, row update, RMSProp) comes from.

:func:`~.fast_path.cut_sources` gives each input one :data:`Source`: a state variable, an
output of the onnxruntime run, a feed of the step, or a fixed array (a learning-rate buffer
or a constant of the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FromState:
    """The state variable ``name``'s live array."""

    name: str


@dataclass(frozen=True)
class FromOutput:
    """The output ``name`` of the program's onnxruntime run (a preallocated buffer after the first)."""

    name: str


@dataclass(frozen=True)
class FromFeed:
    """The step's feed ``name`` (or that input's default)."""

    name: str


Source = FromState | FromOutput | FromFeed | np.ndarray
"""An input's origin; a bare array is a fixed value (learning-rate buffer, constant)."""
