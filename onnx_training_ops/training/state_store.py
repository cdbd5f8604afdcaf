"""A session's state part: one numpy array per state variable, and the parameters around it.

:class:`StateStore` owns the arrays every program binds (zero-copy, :mod:`.binding`), their
initial values (the model's initializers), which parameters a nominal checkpoint has not
filled yet, and the parameters as one flat vector (:mod:`.flat_parameters`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..errors import TrainingOpError
from ..storage.large_model import LargeModel
from .arrays import dtype_name
from .flat_parameters import contiguous, flat_copy, parameter_names, split_into
from .state import reset_state, run_initialization, zero_fill


class StateStore:
    """The state variables of one training model as host (numpy) arrays.

    Every state variable is one array for the store's whole life: programs bind these arrays
    (onnxruntime reads them, the fused kernels and ``update_binding`` write them in place), so
    :meth:`load`, :meth:`reset` and the flat-parameter writes copy *into* them, never replace
    them. The trainables are laid out as views of one buffer when they can be
    (:meth:`flat_parameters` with ``copy=False``).

    The seam for a device-resident state (issue 28): another implementation of this part holds
    each state variable as an ``OrtValue`` on the device, two sets of them as
    :class:`~onnx_training_ops.export.device.DeviceTrainer` does (a step reads one set and
    writes the other through IOBinding, then the sets swap), and keeps this interface:
    ``names``, ``copy`` (device → host copies), ``load`` (host → device, checked first),
    ``views`` (refused there: no host array is live), ``reset``, the flat-parameter methods and
    the nominal bookkeeping. Programs would then bind ``OrtValue``s from the store instead of
    numpy arrays: the part that opens programs asks the store for its values and the loop never
    touches ``arrays`` itself, which is what keeps that swap local to the store and the binding.
    """

    def __init__(self, model: LargeModel, arrays: dict[str, np.ndarray], protos: Mapping[str, onnx.TensorProto],
                 meta: Mapping[str, str]) -> None:
        """The store over ``arrays``, nothing bound yet.

        Args:
            model: the session's training model (message and big arrays).
            arrays: state variable name -> its array (the store keeps these very arrays).
            protos: the state variables' initializers (their initial values).
            meta: the builder's metadata (``trainable`` lists the trained parameters).
        """
        self.model = model
        self.arrays = arrays
        self.protos = dict(protos)
        self.zero_filled = frozenset(n for n, p in self.protos.items() if zero_fill(model, p))
        self.unfilled: set[str] = set()
        self._meta = meta
        self._init_sessions: list = []

    @property
    def names(self) -> list[str]:
        """The state variables' names, in the model's order."""
        return list(self.arrays)

    def copy(self) -> dict[str, np.ndarray]:
        """A copy of every state variable."""
        return {name: value.copy() for name, value in self.arrays.items()}

    def load(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy ``state`` into the state variables (``load_state_dict``): all checked first."""
        self.check_names(state, strict)
        checked = {}
        for name, value in state.items():
            target, value = self.arrays[name], np.asarray(value)
            if value.dtype != target.dtype:
                raise TrainingOpError(f"load_state_dict: state variable {name!r} is "
                                      f"{dtype_name(target.dtype)}, found {dtype_name(value.dtype)}")
            if value.shape != target.shape:
                raise TrainingOpError(f"load_state_dict: state variable {name!r} has shape "
                                      f"{list(target.shape)}, found {list(value.shape)}")
            checked[name] = value
        for name, value in checked.items():
            np.copyto(self.arrays[name], value)
        self.unfilled.difference_update(checked)

    def described(self) -> Mapping[str, Any]:
        """Each state variable's ``shape``, ``dtype`` and ``size`` (what summaries read): the arrays."""
        return self.arrays

    def for_writing(self) -> Mapping[str, Any]:
        """The state as a writer that takes one tensor at a time reads it: the live arrays."""
        return self.arrays

    def check_names(self, state: Mapping[str, Any], strict: bool) -> None:
        """``load_state_dict``'s names: none unknown, and (``strict``) none missing."""
        unknown = [k for k in state if k not in self.arrays]
        if unknown:
            raise TrainingOpError(f"load_state_dict: unknown state variable(s) {unknown}; known: {self.names}")
        if strict:
            missing = [k for k in self.arrays if k not in state]
            if missing:
                raise TrainingOpError(f"load_state_dict: missing state variable(s) {missing}")

    def views(self, names: Sequence[str]) -> list[np.ndarray]:
        """The live arrays of ``names`` (``state_views``)."""
        unknown = [n for n in names if n not in self.arrays]
        if unknown:
            raise TrainingOpError(f"state_views: unknown state variable(s) {unknown}")
        return [self.arrays[n] for n in names]

    def reset(self, open_session: Callable[[onnx.ModelProto], Any]) -> None:
        """Every state variable back to its initializer, then the initialization graphs run
        (``open_session`` opens an onnxruntime session for one, once)."""
        for name, proto in self.protos.items():
            reset_state(self.arrays, name, proto, self.model)
        run_initialization(self.model.model_proto, self.arrays, self._init_sessions, open_session)

    # ------------------------------------------------------------------ parameters

    def trainable_names(self) -> list[str]:
        """The trainables in the builder's order; for a hand-written model, the state
        variables that are initializers of the main graph."""
        listed = [n for n in self._meta.get("trainable", "").split(",") if n]
        if listed:
            return listed
        main = {t.name for t in self.model.model_proto.graph.initializer}
        return [n for n in self.arrays if n in main]

    def parameters(self, trainable_only: bool) -> dict[str, np.ndarray]:
        """name -> live state array (trainables) or the model's value (frozen), in flat order."""
        names = parameter_names(self.model.model_proto, self.trainable_names(), trainable_only)
        constants = {t.name: t for t in self.model.model_proto.graph.initializer}
        return {n: self.arrays[n] if n in self.arrays else self.model.array(constants[n]) for n in names}

    def flat_parameters(self, trainable_only: bool, copy: bool) -> np.ndarray:
        """The parameters raveled into one vector (``get_flat_parameters``)."""
        params = self.parameters(trainable_only)
        if copy:
            return flat_copy(list(params.values()), list(params), "get_flat_parameters")
        live = all(n in self.arrays for n in params)
        buffer = contiguous(list(params.values())) if live else None
        if buffer is None:
            reason = ("the frozen parameters are constants of the model, not state" if not live else
                      "they are laid out per optimizer node (parameter groups), not as one buffer")
            raise TrainingOpError(f"get_flat_parameters(copy=False): the parameters are not one live "
                                  f"buffer: {reason}; use copy=True")
        return buffer

    def load_flat_parameters(self, buffer: Any, trainable_only: bool) -> dict[str, np.ndarray]:
        """Copy ``buffer`` into the trainables; returns the frozen parameters whose values
        change (constants of the model: the caller reopens its programs with them)."""
        params = self.parameters(trainable_only)
        values = split_into(buffer, params, "load_flat_parameters")
        for name, value in values.items():
            if name in self.arrays:
                np.copyto(self.arrays[name], value)
        self.unfilled.difference_update(values)
        return {n: v for n, v in values.items() if n not in self.arrays and not np.array_equal(v, params[n])}

    def check_filled(self, what: str) -> None:
        """Refuse ``what`` while a nominal session's parameters have no values yet."""
        if self.unfilled:
            missing = sorted(self.unfilled)
            raise TrainingOpError(
                f"{what}: this session was opened from a nominal checkpoint and {len(missing)} parameter(s) "
                f"have no values yet ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                "load them first with load_flat_parameters(buffer, trainable_only=False)")
