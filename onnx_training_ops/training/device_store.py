"""A session's state part when the state lives on a device: :class:`DeviceStateStore`.

The same interface as :class:`~.state_store.StateStore` (what the session, its checkpointer and
its summaries call), over :class:`~.device_state.DeviceValues` instead of host arrays. No host
copy of the state is kept: ``arrays`` is a read-only mapping that copies one tensor from the
device when it is read, so a checkpoint streams the state tensor by tensor (device → disk, no
second full host copy). What needs live host memory (``state_views``,
``get_flat_parameters(copy=False)``) is refused with the way to get a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ..errors import TrainingOpError
from ..storage.large_model import LargeModel
from ..storage.tensors import MIN_DETACHED_BYTES, Deferred
from .device_state import DeviceValues
from .flat_parameters import flat_copy, split_into
from .state import reset_state, run_initialization
from .state_store import StateStore


class DeviceArrays(Mapping[str, np.ndarray]):
    """Host copies of device-resident state, made one tensor at a time when read."""

    def __init__(self, values: DeviceValues, names: Sequence[str]) -> None:
        self._values, self._names = values, list(names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._values.download(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


@dataclass(frozen=True)
class Described:
    """A device tensor's shape and dtype, known without a copy to the host."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class DeviceStateStore(StateStore):
    """The state variables of one training model as OrtValues on a device.

    Args:
        model: the session's training model (message and big arrays).
        arrays: state variable name -> its initial value (copied to the device, not kept).
        protos: the state variables' initializers.
        meta: the builder's metadata.
        device: the OrtValue device type (``"cuda"``, ``"cpu"``...).
        device_id: the device's index.
    """

    def __init__(self, model: LargeModel, arrays: dict[str, np.ndarray], protos: Mapping[str, onnx.TensorProto],
                 meta: Mapping[str, str], device: str, device_id: int) -> None:
        names = list(arrays)
        self.values = DeviceValues(arrays, device, device_id)
        super().__init__(model, DeviceArrays(self.values, names), protos, meta)  # type: ignore[arg-type]

    @property
    def device(self) -> str:
        return self.values.device

    def copy(self) -> dict[str, np.ndarray]:
        return {name: self.values.download(name) for name in self.arrays}

    def load(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy ``state`` to the device (``load_state_dict``): every value checked first."""
        self.check_names(state, strict)
        checked = {name: self.values.check(name, value, "load_state_dict") for name, value in state.items()}
        for name, value in checked.items():
            self.values.upload(name, value)
        self.unfilled.difference_update(checked)

    def described(self) -> Mapping[str, Any]:
        """Shapes and dtypes of the device tensors, nothing copied."""
        return {name: Described(self.values.shape(name), self.values.dtype(name)) for name in self.arrays}

    def for_writing(self) -> Mapping[str, Any]:
        """Each big tensor :class:`~onnx_training_ops.storage.tensors.Deferred` (copied from the
        device when the writer reaches it: one host copy at a time), small ones copied now."""
        values = self.values
        out: dict[str, Any] = {}
        for name in self.arrays:
            nbytes = int(np.prod(values.shape(name), dtype=np.int64)) * values.dtype(name).itemsize
            out[name] = Deferred(functools.partial(values.download, name)) if nbytes >= MIN_DETACHED_BYTES \
                else values.download(name)
        return out

    def views(self, names: Sequence[str]) -> list[np.ndarray]:
        raise TrainingOpError(f"state_views: the state lives on the device ({self.device!r}), not in host "
                              "arrays; use state_dict() for copies and load_state_dict() to write")

    def reset(self, open_session: Callable[[onnx.ModelProto], Any]) -> None:
        """Every state variable back to its initializer and the initialization graphs run (on
        host copies), then copied to the device."""
        host = {name: np.empty(self.values.shape(name), self.values.dtype(name)) for name in self.arrays}
        for name, proto in self.protos.items():
            reset_state(host, name, proto, self.model)
        run_initialization(self.model.model_proto, host, self._init_sessions, open_session)
        for name, value in host.items():
            self.values.upload(name, value)

    def parameters(self, trainable_only: bool) -> dict[str, np.ndarray]:
        """name -> host copy (trainables) or the model's value (frozen), in flat order."""
        return dict(super().parameters(trainable_only))

    def flat_parameters(self, trainable_only: bool, copy: bool) -> np.ndarray:
        if not copy:
            raise TrainingOpError(f"get_flat_parameters(copy=False): the parameters live on the device "
                                  f"({self.device!r}), not in one host buffer; use copy=True")
        params = self.parameters(trainable_only)
        return flat_copy(list(params.values()), list(params), "get_flat_parameters")

    def load_flat_parameters(self, buffer: Any, trainable_only: bool) -> dict[str, np.ndarray]:
        params = self.parameters(trainable_only)
        values = split_into(buffer, params, "load_flat_parameters")
        for name, value in values.items():
            if name in self.arrays:
                self.values.upload(name, np.ascontiguousarray(value).reshape(self.values.shape(name)))
        self.unfilled.difference_update(values)
        return {n: v for n, v in values.items() if n not in self.arrays and not np.array_equal(v, params[n])}


__all__ = ["Described", "DeviceArrays", "DeviceStateStore"]
