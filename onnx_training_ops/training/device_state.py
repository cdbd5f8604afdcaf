"""State variables resident on a device: one OrtValue each, and a spare for two-set writes.

onnxruntime copies a host array bound as an input of a device node once, at bind time
(``IOBinding::BindInput``), so a device-resident session never binds host arrays for its
state: :class:`DeviceValues` holds every state variable (parameters, optimizer state, update
counts, accumulated gradients) as an ``OrtValue`` allocated on the device. A program either
writes new values over the old ones (in place, guarded) or into *spare* values, which become
the state when the step is kept (:meth:`DeviceValues.commit`); a skipped step leaves the
state as it was without a copy. Values move to and from the host only when asked:
:meth:`DeviceValues.download` (``state_dict``, checkpoints, one tensor at a time) and
:meth:`DeviceValues.upload` (``load_state_dict``), which copies into the existing device
buffer (its address stays, as CUDA graphs need).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import onnxruntime as ort

from ..errors import TrainingOpError
from .arrays import dtype_name

# OrtValue.data_type() text -> numpy dtype
_NUMPY_OF = {"float": "float32", "double": "float64", "float16": "float16"}


def numpy_type(value: ort.OrtValue) -> np.dtype:
    """The numpy dtype of an OrtValue's ``tensor(...)`` type."""
    text = value.data_type()[len("tensor("):-1]
    return np.dtype(_NUMPY_OF.get(text, text))


class DeviceValues:
    """Named tensors on one device (``"cpu"``, ``"cuda"``...), with spares for two-set writes.

    Args:
        arrays: name -> initial value (copied to the device).
        device: the OrtValue device type.
        device_id: the device's index.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], device: str = "cpu", device_id: int = 0) -> None:
        self.device, self.device_id = device, int(device_id)
        self.values: dict[str, ort.OrtValue] = {}
        self._spares: dict[str, ort.OrtValue] = {}
        for name, array in arrays.items():
            self.add(name, array)

    def add(self, name: str, array: np.ndarray) -> None:
        """A new device tensor ``name`` holding a copy of ``array``."""
        host = np.array(array, order="C")  # a copy, 0-d kept 0-d (ascontiguousarray makes it 1-d)
        self.values[name] = ort.OrtValue.ortvalue_from_numpy(host, self.device, self.device_id)

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def dtype(self, name: str) -> np.dtype:
        return numpy_type(self.values[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.values[name].shape())

    def spare(self, name: str) -> ort.OrtValue:
        """The second buffer of ``name`` a two-set program writes (allocated on first use)."""
        spare = self._spares.get(name)
        if spare is None:
            current = self.values[name]
            spare = ort.OrtValue.ortvalue_from_shape_and_type(list(current.shape()), numpy_type(current),
                                                              self.device, self.device_id)
            self._spares[name] = spare
        return spare

    @property
    def spares(self) -> int:
        """How many spare buffers exist (none while every program writes in place)."""
        return len(self._spares)

    def commit(self, names: Iterable[str]) -> None:
        """The spares of ``names`` hold the new state: swap them in (the old values become spares)."""
        for name in names:
            self.values[name], self._spares[name] = self._spares[name], self.values[name]

    def download(self, name: str) -> np.ndarray:
        """A host copy of ``name`` (a CPU OrtValue's ``numpy()`` is a view of the live buffer,
        which an in-place step would change under the caller)."""
        host = self.values[name].numpy()
        return host.copy() if self.device == "cpu" else host

    def check(self, name: str, value: np.ndarray, what: str) -> np.ndarray:
        """``value`` as a host array fit for ``name`` (dtype and shape), else a clear error."""
        array = np.asarray(value)
        dtype, shape = self.dtype(name), self.shape(name)
        if array.dtype != dtype:
            raise TrainingOpError(f"{what}: state variable {name!r} is {dtype_name(dtype)}, "
                                  f"found {dtype_name(array.dtype)}")
        if array.shape != shape:
            raise TrainingOpError(f"{what}: state variable {name!r} has shape {list(shape)}, "
                                  f"found {list(array.shape)}")
        return array

    def upload(self, name: str, array: np.ndarray) -> None:
        """Copy ``array`` (checked by :meth:`check`) into the device buffer of ``name``."""
        self.values[name].update_inplace(np.array(array, order="C"))

    def nbytes(self) -> int:
        """Bytes the current values take on the device (spares not counted)."""
        return sum(int(np.prod(self.shape(n), dtype=np.int64)) * self.dtype(n).itemsize for n in self.values)


__all__ = ["DeviceValues", "numpy_type"]
