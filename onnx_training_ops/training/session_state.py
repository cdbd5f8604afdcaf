"""Part of :class:`~onnx_training_ops.TrainingSession`: its state variables, read, written, reset."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import TrainingOpError
from ..runtime.session import InferenceSession
from .arrays import dtype_name
from .locked import locked
from .state import reset_state, run_initialization


class StateAccess:
    """``state_names``, ``state_dict``, ``load_state_dict``, ``state_views``, ``initialize``
    (a mixin of TrainingSession: ``self._state`` holds one array per state variable)."""

    @property
    def state_names(self) -> list[str]:
        """Names of the state variables (parameters, optimizer state, update count)."""
        return list(self._state)

    @locked
    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state variable."""
        return {name: value.copy() for name, value in self._state.items()}

    @locked
    def load_state_dict(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy values into the state variables (same dtype and shape required).

        Args:
            state: state variable name -> array.
            strict: the keys must be exactly the state variables; False: unknown keys still raise
                and missing ones keep their value.

        Raises:
            TrainingOpError: an unknown or (strict) missing name, or a dtype or shape that differs;
                nothing is changed then.
        """
        unknown = [k for k in state if k not in self._state]
        if unknown:
            raise TrainingOpError(f"load_state_dict: unknown state variable(s) {unknown}; known: {self.state_names}")
        if strict:
            missing = [k for k in self._state if k not in state]
            if missing:
                raise TrainingOpError(f"load_state_dict: missing state variable(s) {missing}")
        checked = {}
        for name, value in state.items():
            target, value = self._state[name], np.asarray(value)
            if value.dtype != target.dtype:
                raise TrainingOpError(f"load_state_dict: state variable {name!r} is "
                                      f"{dtype_name(target.dtype)}, found {dtype_name(value.dtype)}")
            if value.shape != target.shape:
                raise TrainingOpError(f"load_state_dict: state variable {name!r} has shape "
                                      f"{list(target.shape)}, found {list(value.shape)}")
            checked[name] = value
        for name, value in checked.items():
            np.copyto(self._state[name], value)
        self._mark_loaded(list(checked))

    @locked
    def initialize(self) -> None:
        """Reset every state variable to its initializer, then run the initialization graphs
        (accumulated gradients are dropped)."""
        self.zero_grad()
        for name, proto in self._state_protos.items():
            reset_state(self._state, name, proto, self._model)
        run_initialization(self._model.model_proto, self._state, self._init_sessions,
                           lambda init: InferenceSession(init, providers=self._providers))

    @locked
    def state_views(self, names: Sequence[str]) -> list[np.ndarray]:
        """The live arrays of the state variables ``names``.

        Writing into them in place (an all-gather or broadcast across processes) changes the state
        the next run reads.

        Args:
            names: state variable names.

        Returns:
            One array per name, the session's own (no copy).

        Raises:
            TrainingOpError: an unknown name.
        """
        unknown = [n for n in names if n not in self._state]
        if unknown:
            raise TrainingOpError(f"state_views: unknown state variable(s) {unknown}")
        return [self._state[n] for n in names]
