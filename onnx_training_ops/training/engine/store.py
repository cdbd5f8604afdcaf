"""The engine's state part: the state variables in a :mod:`.memory`, and the parameters around them.

:class:`StateStore` owns the memory every program binds, the state's initial values (the
model's initializers), which parameters a nominal checkpoint has not filled yet, and the
parameters as one flat vector (:mod:`..state.flat_parameters`). Its interface is the same whichever
memory holds the tensors; what differs is whether a live host array exists:

* host memory: ``arrays`` is the live dict (programs bind these arrays zero-copy, the fused
  kernels and ``update_binding`` write them in place; :meth:`load`, :meth:`reset` and the
  flat-parameter writes copy *into* them, never replace them); ``state_views`` and
  ``get_flat_parameters(copy=False)`` hand them out;
* device memory: ``arrays`` is a read-only mapping that copies one tensor from the device when
  read, so a checkpoint streams the state tensor by tensor (device -> disk, no second full host
  copy); what needs live host memory is refused, naming the way to get a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...storage.large_model import LargeModel
from ...storage.tensors import MIN_DETACHED_BYTES, Deferred
from ..arrays import dtype_name
from ..state.flat_parameters import contiguous, flat_copy, parameter_names, split_into
from ..state.state import reset_state, run_initialization, zero_fill
from .memory import DeviceMemory, HostMemory, StateMemory


class DeviceArrays(Mapping[str, np.ndarray]):
    """Host copies of device-resident state, made one tensor at a time when read."""

    def __init__(self, memory: StateMemory, names: Sequence[str]) -> None:
        self._memory, self._names = memory, list(names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._memory.download(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


@dataclass(frozen=True)
class Described:
    """A tensor's shape and dtype, known without a copy to the host."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class StateStore:
    """The state variables of one training model, in host or device memory.

    Args:
        model: the session's training model (message and big arrays).
        memory: where the tensors live; a :class:`~.memory.HostMemory`'s ``arrays`` are the
            state variables themselves.
        protos: the state variables' initializers (their initial values).
        meta: the builder's metadata (``trainable`` lists the trained parameters).
    """

    def __init__(self, model: LargeModel, memory: StateMemory, protos: Mapping[str, onnx.TensorProto],
                 meta: TrainingMetadata) -> None:
        self.model = model
        self.memory = memory
        self.protos = dict(protos)
        self.arrays: Mapping[str, np.ndarray] = memory.arrays if isinstance(memory, HostMemory) \
            else DeviceArrays(memory, list(self.protos))
        self.zero_filled = frozenset(n for n, p in self.protos.items() if zero_fill(model, p))
        self.unfilled: set[str] = set()
        self._meta = meta
        self._init_sessions: list = []

    @classmethod
    def open(cls, model: LargeModel, arrays: dict[str, np.ndarray], protos: Mapping[str, onnx.TensorProto],
             meta: TrainingMetadata, host: bool, device: str = "cpu", device_id: int = 0) -> StateStore:
        """The store over ``arrays``: kept as they are (``host``), or copied to ``device`` (the
        caller drops them)."""
        memory: StateMemory = HostMemory(arrays) if host else DeviceMemory(arrays, device, device_id)
        return cls(model, memory, protos, meta)

    @property
    def live(self) -> bool:
        """Whether the state is host arrays the caller may hold views of."""
        return self.memory.host

    @property
    def names(self) -> list[str]:
        """The state variables' names, in the model's order."""
        return list(self.arrays)

    def copy(self) -> dict[str, np.ndarray]:
        """A copy of every state variable."""
        return self.memory.download_many(self.arrays)

    def load(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy ``state`` into the state variables (``load_state_dict``): all checked first."""
        self.check_names(state, strict)
        checked = {}
        for name, value in state.items():
            value = np.asarray(value)
            dtype, shape = self.memory.dtype(name), self.memory.shape(name)
            if value.dtype != dtype:
                raise TrainingOpError(f"load_state_dict: state variable {name!r} is "
                                      f"{dtype_name(dtype)}, found {dtype_name(value.dtype)}")
            if value.shape != shape:
                raise TrainingOpError(f"load_state_dict: state variable {name!r} has shape "
                                      f"{list(shape)}, found {list(value.shape)}")
            checked[name] = value
        for name, value in checked.items():
            self.memory.upload(name, value)
        self.unfilled.difference_update(checked)

    def described(self) -> Mapping[str, Any]:
        """Each state variable's ``shape``, ``dtype`` and ``size`` (what summaries read), nothing copied."""
        if self.live:
            return self.arrays
        return {name: Described(self.memory.shape(name), self.memory.dtype(name)) for name in self.arrays}

    def for_writing(self) -> Mapping[str, Any]:
        """The state as a writer that takes one tensor at a time reads it: the live arrays, or
        each big device tensor :class:`~onnx_training_ops.storage.tensors.Deferred` (copied
        when the writer reaches it: one host copy at a time), small ones copied now."""
        if self.live:
            return self.arrays
        out: dict[str, Any] = {}
        for name in self.arrays:
            described = Described(self.memory.shape(name), self.memory.dtype(name))
            out[name] = Deferred(functools.partial(self.memory.download, name)) \
                if described.size * described.dtype.itemsize >= MIN_DETACHED_BYTES else self.memory.download(name)
        return out

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
        if not self.live:
            raise TrainingOpError(f"state_views: the state lives on the device ({self.memory.device!r}), not in host "
                                  "arrays; use state_dict() for copies and load_state_dict() to write, "
                                  "state_tensors() to share them (DLPack)")
        unknown = [n for n in names if n not in self.arrays]
        if unknown:
            raise TrainingOpError(f"state_views: unknown state variable(s) {unknown}")
        return [self.arrays[n] for n in names]

    def exported(self, names: Sequence[str]) -> list[Any]:
        """The live buffers of ``names`` in either memory, as DLPack exporters (``state_tensors``)."""
        unknown = [n for n in names if n not in self.arrays]
        if unknown:
            raise TrainingOpError(f"state_tensors: unknown state variable(s) {unknown}")
        return [self.memory.exported(n) for n in names]

    def reset(self, open_session: Callable[[onnx.ModelProto], Any]) -> None:
        """Every state variable back to its initializer, then the initialization graphs run
        (``open_session`` opens an onnxruntime session for one, once); on a device, on host
        copies then copied up."""
        target = self.arrays if self.live else \
            {name: np.empty(self.memory.shape(name), self.memory.dtype(name)) for name in self.arrays}
        for name, proto in self.protos.items():
            reset_state(target, name, proto, self.model)  # type: ignore[arg-type]
        run_initialization(self.model.model_proto, target, self._init_sessions, open_session)  # type: ignore[arg-type]
        if not self.live:
            for name, value in target.items():
                self.memory.upload(name, value)

    # ------------------------------------------------------------------ parameters

    def trainable_names(self) -> list[str]:
        """The trainables in the builder's order; for a hand-written model, the state
        variables that are initializers of the main graph."""
        listed = list(self._meta.trainable)
        if listed:
            return listed
        main = {t.name for t in self.model.model_proto.graph.initializer}
        return [n for n in self.arrays if n in main]

    def parameters(self, trainable_only: bool) -> dict[str, np.ndarray]:
        """name -> state array (live, or a host copy from a device) or the model's value
        (frozen), in flat order."""
        names = parameter_names(self.model.model_proto, self.trainable_names(), trainable_only)
        constants = {t.name: t for t in self.model.model_proto.graph.initializer}
        return {n: self.arrays[n] if n in self.arrays else self.model.array(constants[n]) for n in names}

    def flat_parameters(self, trainable_only: bool, copy: bool) -> np.ndarray:
        """The parameters raveled into one vector (``get_flat_parameters``)."""
        params = self.parameters(trainable_only)
        if copy:
            return flat_copy(list(params.values()), list(params), "get_flat_parameters")
        if not self.live:
            raise TrainingOpError(f"get_flat_parameters(copy=False): the parameters live on the device "
                                  f"({self.memory.device!r}), not in one host buffer; use copy=True")
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
                self.memory.upload(name, np.ascontiguousarray(value).reshape(self.memory.shape(name)))
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


__all__ = ["Described", "DeviceArrays", "StateStore"]
