"""Where the engine's state lives: the memory strategy, chosen once when a session opens.

Every state variable (parameters, optimizer state, update counts) and every accumulated
gradient is one tensor for the session's whole life. A program reads it as a bound input and,
when it writes in place, as the output bound onto the same buffer (:mod:`.graph`); the fused
kernels write host arrays directly (:mod:`.fused`).

* :class:`HostMemory`: numpy arrays the session owns, handed to onnxruntime as OrtValues over
  the same memory (zero-copy). Views of them (``state_views``, ``gradient_buffers``,
  ``get_flat_parameters(copy=False)``) are live.
* :class:`DeviceMemory`: OrtValues allocated on a device (``"cuda"``...): onnxruntime copies a
  host array bound as an input of a device node once, at bind time (``IOBinding::BindInput``),
  so a device session never binds host arrays for its state. Values move to and from the host
  only when asked (:meth:`~StateMemory.download`, :meth:`~StateMemory.upload`).

Both hold the accumulated gradients as one flat buffer per dtype (:meth:`~StateMemory.add_flat`):
each accumulator is a slice of it (:meth:`~StateMemory.located`), bound by address on a device,
so a step's gradients are one block to all-reduce or zero. Both hand their live buffers out as
DLPack exporters (:meth:`~StateMemory.exported`: the numpy array, or the OrtValue), which torch
wraps without a copy: how data-parallel training reduces the gradients in place.

A program that cannot write in place writes into *spares*, which :meth:`~StateMemory.commit`
makes the state (a skipped step leaves the state as it was).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper

from ...errors import TrainingOpError
from ..options.providers import device_providers

# OrtValue.data_type() text -> numpy dtype
_NUMPY_OF = {"float": "float32", "double": "float64", "float16": "float16"}


def numpy_type(value: ort.OrtValue) -> np.dtype:
    """The numpy dtype of an OrtValue's ``tensor(...)`` type."""
    text = value.data_type()[len("tensor("):-1]
    return np.dtype(_NUMPY_OF.get(text, text))


@runtime_checkable
class StateMemory(Protocol):
    """Named tensors of one session on one device, bound to onnxruntime by name."""

    device: str  # the OrtValue device type: "cpu", "cuda", "dml"
    device_id: int
    host: bool  # the tensors are the session's own numpy arrays (views of them are live)

    def __contains__(self, name: object) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> np.dtype: ...

    def token(self, name: str) -> int:
        """Changes whenever ``name``'s buffer does (a binding made for the old one is stale)."""
        ...

    def bind_input(self, io: ort.IOBinding, input_name: str, name: str) -> None:
        """Bind ``name``'s current buffer as the graph input ``input_name``."""
        ...

    def bind_output(self, io: ort.IOBinding, output_name: str, name: str, spare: bool) -> None:
        """Bind ``name``'s buffer (``spare``: its second one) as the graph output ``output_name``."""
        ...

    def commit(self, names: Iterable[str]) -> None:
        """The spares of ``names`` hold the new values: make them the state."""
        ...

    def download(self, name: str) -> np.ndarray:
        """A host copy of ``name`` (never a view of the live buffer)."""
        ...

    def download_many(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Host copies of ``names`` (a flat buffer copied once for all its slices)."""
        ...

    def upload(self, name: str, array: np.ndarray) -> None:
        """Copy ``array`` into ``name``'s buffer (its address stays, as CUDA graphs need)."""
        ...

    def add_flat(self, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """New tensors holding copies of ``arrays``, as slices of one flat buffer per dtype (in
        ``arrays``' order); returns the buffers."""
        ...

    def located(self, name: str) -> tuple[Any, int]:
        """The flat buffer (from :meth:`add_flat`) holding ``name`` and its element offset there."""
        ...

    def exported(self, name: str) -> Any:
        """``name``'s live buffer as a DLPack exporter (``torch.from_dlpack`` shares its memory):
        the numpy array in host memory, the OrtValue on a device (a two-set program's commit
        swaps it for its spare: take it again after a step)."""
        ...

    def zero(self, buffers: Iterable[Any]) -> None:
        """Write zeros over ``buffers`` (from :meth:`add_flat`)."""
        ...

    def constant(self, name: str, array: np.ndarray) -> ort.OrtValue:
        """A frozen tensor of the model as an OrtValue in this memory, made once and shared by
        every program that reads it (onnxruntime would copy it into each session as an
        initializer: a LoRA base model once per program)."""
        ...


class HostMemory:
    """State as host arrays: ``arrays`` (the state variables, the very dict the state store and
    the fused kernels use) and the accumulators, each bound zero-copy."""

    host = True

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.device, self.device_id = "cpu", 0
        self.arrays = arrays
        self.extra: dict[str, np.ndarray] = {}  # accumulators: not state variables
        self._located: dict[str, tuple[np.ndarray, int]] = {}
        self._values: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}
        self._spares: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}
        self._constants: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}

    def array(self, name: str) -> np.ndarray:
        found = self.arrays.get(name)
        return self.extra[name] if found is None else found

    def __contains__(self, name: object) -> bool:
        return name in self.arrays or name in self.extra

    def shape(self, name: str) -> tuple[int, ...]:
        return self.array(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self.array(name).dtype

    def value(self, name: str) -> ort.OrtValue:
        """An OrtValue over ``name``'s array (made again if the array was re-homed)."""
        array = self.array(name)
        cached = self._values.get(name)
        if cached is None or cached[0] is not array:
            cached = (array, ort.OrtValue.ortvalue_from_numpy(array))
            self._values[name] = cached
        return cached[1]

    def token(self, name: str) -> int:
        return id(self.value(name))

    def bind_input(self, io: ort.IOBinding, input_name: str, name: str) -> None:
        io.bind_ortvalue_input(input_name, self.value(name))

    def bind_output(self, io: ort.IOBinding, output_name: str, name: str, spare: bool) -> None:
        if not spare:
            io.bind_ortvalue_output(output_name, self.value(name))
            return
        found = self._spares.get(name)
        if found is None:
            array = np.empty_like(self.array(name))
            found = self._spares[name] = (array, ort.OrtValue.ortvalue_from_numpy(array))
        io.bind_ortvalue_output(output_name, found[1])

    @property
    def spares(self) -> int:
        return len(self._spares)

    def commit(self, names: Iterable[str]) -> None:
        for name in names:  # copied: the state arrays (and every view of them) stay the same
            np.copyto(self.array(name), self._spares[name][0])

    def download(self, name: str) -> np.ndarray:
        return self.array(name).copy()

    def download_many(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {name: self.download(name) for name in names}

    def upload(self, name: str, array: np.ndarray) -> None:
        np.copyto(self.array(name), array)

    def add_flat(self, arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        views, buffers = flat_arrays(arrays)
        self.extra.update(views)
        self._located.update(_offsets(views, buffers))
        return buffers

    def located(self, name: str) -> tuple[np.ndarray, int]:
        return self._located[name]

    def exported(self, name: str) -> np.ndarray:
        return self.array(name)

    def constant(self, name: str, array: np.ndarray) -> ort.OrtValue:
        found = self._constants.get(name)
        if found is None:
            host = array if array.flags.c_contiguous else np.ascontiguousarray(array)
            found = self._constants[name] = (host, ort.OrtValue.ortvalue_from_numpy(host))
        return found[1]

    def zero(self, buffers: Iterable[np.ndarray]) -> None:
        for buffer in buffers:
            buffer.fill(0)


class DeviceMemory:
    """State as OrtValues on a device, with a spare each for two-set writes (made on first use);
    accumulators as slices of one device buffer per dtype, bound by address.

    Args:
        arrays: name -> initial value (copied to the device, not kept).
        device: the OrtValue device type.
        device_id: the device's index.
    """

    host = False

    def __init__(self, arrays: Mapping[str, np.ndarray], device: str = "cpu", device_id: int = 0) -> None:
        self.device, self.device_id = device, int(device_id)
        self.values: dict[str, ort.OrtValue] = {}
        self._spares: dict[str, ort.OrtValue] = {}
        # accumulators: name -> (flat buffer, byte offset, shape, dtype)
        self.slices: dict[str, tuple[ort.OrtValue, int, tuple[int, ...], np.dtype]] = {}
        self._helpers: dict[tuple, _Helper] = {}  # small device sessions: copies, fills
        self._constants: dict[str, ort.OrtValue] = {}
        for name, array in arrays.items():
            self.values[name] = self._new(array)

    def _new(self, array: np.ndarray) -> ort.OrtValue:
        host = np.array(array, order="C")  # a copy, 0-d kept 0-d (ascontiguousarray makes it 1-d)
        return ort.OrtValue.ortvalue_from_numpy(host, self.device, self.device_id)

    def __contains__(self, name: object) -> bool:
        return name in self.values or name in self.slices

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def dtype(self, name: str) -> np.dtype:
        found = self.slices.get(name)
        return found[3] if found is not None else numpy_type(self.values[name])

    def shape(self, name: str) -> tuple[int, ...]:
        found = self.slices.get(name)
        return found[2] if found is not None else tuple(self.values[name].shape())

    def token(self, name: str) -> int:
        return id(self.values[name]) if name in self.values else id(self.slices[name][0])

    def bind_input(self, io: ort.IOBinding, input_name: str, name: str) -> None:
        found = self.slices.get(name)
        if found is None:
            io.bind_ortvalue_input(input_name, self.values[name])
        else:
            buffer, offset, shape, dtype = found
            io.bind_input(input_name, self.device, self.device_id, dtype, list(shape), buffer.data_ptr() + offset)

    def bind_output(self, io: ort.IOBinding, output_name: str, name: str, spare: bool) -> None:
        found = self.slices.get(name)
        if found is not None and not spare:
            buffer, offset, shape, dtype = found
            io.bind_output(output_name, self.device, self.device_id, dtype, list(shape), buffer.data_ptr() + offset)
        else:
            io.bind_ortvalue_output(output_name, self.spare(name) if spare else self.values[name])

    def spare(self, name: str) -> ort.OrtValue:
        """The second buffer of ``name`` a two-set program writes (allocated on first use)."""
        spare = self._spares.get(name)
        if spare is None:
            spare = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape(name)), self.dtype(name),
                                                              self.device, self.device_id)
            self._spares[name] = spare
        return spare

    @property
    def spares(self) -> int:
        """How many spare buffers exist (none while every program writes in place)."""
        return len(self._spares)

    def commit(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self.slices:  # a slice keeps its place in its buffer: the spare is copied in
                self._copy(self._spares[name], name)
            else:
                self.values[name], self._spares[name] = self._spares[name], self.values[name]

    def _copy(self, source: ort.OrtValue, name: str) -> None:
        """``source`` copied into ``name``'s buffer, on the device (an Identity run)."""
        io = self._helper("copy", self.dtype(name)).session.io_binding()
        io.bind_ortvalue_input("x", source)
        self.bind_output(io, "y", name, spare=False)
        self._helper("copy", self.dtype(name)).session.run_with_iobinding(io)

    def download(self, name: str) -> np.ndarray:
        if name in self.slices:
            return self.download_many([name])[name]
        host = self.values[name].numpy()
        return host.copy() if self.device == "cpu" else host

    def download_many(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Host copies of ``names``, each flat buffer copied once for all its slices."""
        hosts: dict[int, np.ndarray] = {}
        out = {}
        for name in names:
            found = self.slices.get(name)
            if found is None:
                out[name] = self.download(name)
                continue
            buffer, offset, shape, dtype = found
            flat = hosts.get(id(buffer))
            if flat is None:
                flat = hosts[id(buffer)] = buffer.numpy().reshape(-1)
            start = offset // dtype.itemsize
            out[name] = flat[start:start + int(np.prod(shape, dtype=np.int64))].reshape(shape).copy()
        return out

    def upload(self, name: str, array: np.ndarray) -> None:
        if name in self.slices:
            self._copy(self._new(array), name)
        else:
            self.values[name].update_inplace(np.array(array, order="C"))

    def add_flat(self, arrays: Mapping[str, np.ndarray]) -> list[ort.OrtValue]:
        views, buffers = flat_arrays(arrays)
        device_buffers = []
        for buffer in buffers:
            device_buffers.append(self._new(buffer))
        for name, (buffer, offset) in _offsets(views, buffers).items():
            device_buffer = device_buffers[next(i for i, b in enumerate(buffers) if b is buffer)]
            self.slices[name] = (device_buffer, offset * buffer.itemsize, views[name].shape, views[name].dtype)
        return device_buffers

    def located(self, name: str) -> tuple[ort.OrtValue, int]:
        buffer, offset, _, dtype = self.slices[name]
        return buffer, offset // dtype.itemsize

    def exported(self, name: str) -> ort.OrtValue:
        if name in self.slices:
            raise TrainingOpError(f"{name!r} is a slice of a flat buffer: export the buffer (located) instead")
        return self.values[name]

    def constant(self, name: str, array: np.ndarray) -> ort.OrtValue:
        found = self._constants.get(name)
        if found is None:
            found = self._constants[name] = self._new(array)
        return found

    def zero(self, buffers: Iterable[ort.OrtValue]) -> None:
        for buffer in buffers:  # a fill on the device per buffer, nothing uploaded
            self._helper("zeros", numpy_type(buffer), tuple(buffer.shape())).fill(buffer)

    def _helper(self, kind: str, dtype: np.dtype, shape: tuple[int, ...] = ()) -> Any:
        key = (kind, dtype, shape)
        found = self._helpers.get(key)
        if found is None:
            found = self._helpers[key] = _Helper(kind, dtype, shape, self.device, self.device_id)
        return found

    def nbytes(self) -> int:
        """Bytes the current values take on the device (spares not counted)."""
        return sum(int(np.prod(self.shape(n), dtype=np.int64)) * self.dtype(n).itemsize for n in self.values)


def flat_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Copies of ``arrays`` as views into one flat buffer per dtype (name order kept), and
    the buffers: one contiguous block per dtype to reduce, zero or inspect."""
    by_dtype: dict[np.dtype, list[str]] = {}
    for name, array in arrays.items():
        by_dtype.setdefault(np.asarray(array).dtype, []).append(name)
    views, buffers = {}, []
    for dtype, names in by_dtype.items():
        flat = np.empty(sum(np.asarray(arrays[n]).size for n in names), dtype)
        offset = 0
        for name in names:
            array = np.asarray(arrays[name])
            views[name] = flat[offset:offset + array.size].reshape(array.shape)
            views[name][...] = array
            offset += array.size
        buffers.append(flat)
    return {name: views[name] for name in arrays}, buffers


def _offsets(views: Mapping[str, np.ndarray], buffers: list[np.ndarray]) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (the buffer of :func:`flat_arrays` that ``views[name]`` lies in: its dtype's, its
    element offset there)."""
    by_dtype = {buffer.dtype: buffer for buffer in buffers}
    out = {}
    for name, view in views.items():
        buffer = by_dtype[view.dtype]
        start = view.__array_interface__["data"][0] - buffer.__array_interface__["data"][0]
        out[name] = (buffer, start // buffer.itemsize)
    return out


class _Helper:
    """A small onnxruntime session on a memory's device: ``copy`` (Identity, ``x`` -> ``y``) or
    ``zeros`` (ConstantOfShape of ``shape``, written over a bound buffer)."""

    def __init__(self, kind: str, dtype: np.dtype, shape: tuple[int, ...], device: str, device_id: int) -> None:
        elem = helper.np_dtype_to_tensor_dtype(dtype)
        if kind == "copy":
            graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "copy",
                                      [helper.make_tensor_value_info("x", elem, None)],
                                      [helper.make_tensor_value_info("y", elem, None)])
        else:
            zero = helper.make_tensor("zero", elem, [1], [0])
            node = helper.make_node("ConstantOfShape", ["shape"], ["y"], value=zero)
            graph = helper.make_graph([node], "zeros", [], [helper.make_tensor_value_info("y", elem, list(shape))],
                                      [numpy_helper.from_array(np.array(shape, np.int64), "shape")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        options = ort.SessionOptions()
        options.log_severity_level = 4
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=device_providers(device, device_id))

    def fill(self, buffer: ort.OrtValue) -> None:
        io = self.session.io_binding()
        io.bind_ortvalue_output("y", buffer)
        self.session.run_with_iobinding(io)


__all__ = ["DeviceMemory", "HostMemory", "StateMemory", "flat_arrays", "numpy_type"]
