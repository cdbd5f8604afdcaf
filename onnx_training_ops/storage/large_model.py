"""LargeModel: a ModelProto whose big tensors live outside protobuf, as numpy arrays.

protobuf cannot serialize a message past 2 GB, and a tensor inside a message is a copy of
it. A :class:`LargeModel` keeps the graphs in a ModelProto and each big tensor as a numpy
array beside it, with onnx's ``ModelContainer`` convention (:mod:`.tensors`): the
TensorProto keeps its name, type and dims, its ``location`` is ``#<key>``, the key of the
array in ``large_initializers``. It *is* an ``onnx.model_container.ModelContainer``, so
onnx's tools that take one (``onnx.reference.ReferenceEvaluator``) take it.

The arrays are treated as immutable: nothing in this package writes into them (a
TrainingSession copies what it trains; constants are read). They may be memory-mapped
files (``np.memmap``, read-only: :mod:`.external_data`) or read-only broadcast views (the
optimizer state a builder creates: :func:`.tensors.constant_array` takes no memory).

It is also the one model type of the package's inner layers, whatever the model's size: a
small model is a LargeModel whose ``large`` is False (its tensors may still be arrays, e.g.
a session's state). Each public entry normalizes what it is given once
(:func:`.model_files.as_model`) and hands back :meth:`LargeModel.public` (a ModelProto for a
small model, as before); nothing between them branches on the type. What differs by size
lives here and in the writers: :attr:`LargeModel.large` decides what ``public`` returns
and whether :meth:`LargeModel.write` puts the tensors in a data file.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.model_container import ModelContainer

from .checkpoint import add_checksums, set_initializer
from .save import save_model
from .tensors import (
    MIN_DETACHED_BYTES,
    add_array,
    all_tensors,
    constant_array,
    graphs_with_tensors,
    large_model_bytes,
    location,
    tensor_nbytes,
    tensor_value,
    whole_proto,
)


class LargeModel(ModelContainer):
    """A ModelProto (``model_proto``) and its big tensors (``large_initializers``, by ``#key``).

    ``large``: whether the model is handled as large (:func:`.tensors.large_model_bytes`):
    a LargeModel made by a caller is; :func:`.model_files.as_model` makes small models
    with ``large=False``.
    """

    def __init__(self, model_proto: onnx.ModelProto | None = None,
                 arrays: Mapping[str, np.ndarray] | None = None, large: bool = True) -> None:
        super().__init__()
        if model_proto is not None:
            self.model_proto = model_proto
        self.large_initializers = dict(arrays or {})
        self.large = large

    @property
    def proto(self) -> onnx.ModelProto:
        """The message (graphs, metadata; the detached tensors' values are not in it)."""
        return self.model_proto

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The values of any tensor of this model: its array if detached, else parsed from
        the message."""
        return tensor_value(tensor, self.large_initializers)

    def copy(self) -> LargeModel:
        """Another LargeModel over a copy of the message and the same (immutable) arrays."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self.model_proto)
        return LargeModel(proto, self.large_initializers, self.large)

    def with_proto(self, model_proto: onnx.ModelProto) -> LargeModel:
        """``model_proto`` (derived from this model's, e.g. by a pass) with this model's arrays,
        keeping only those it still refers to."""
        used = {location(t) for t in all_tensors(model_proto)}
        return LargeModel(model_proto, {k: v for k, v in self.large_initializers.items() if k in used}, self.large)

    def set_value(self, tensor: onnx.TensorProto, value: np.ndarray, copy: bool = True) -> None:
        """Give ``tensor`` (of this model's message) the values ``value``: a big one becomes
        an array (a copy of ``value``, or with ``copy=False`` the very array, for a writer
        that holds it still), a small one goes into the message."""
        if tensor_nbytes(tensor) >= MIN_DETACHED_BYTES and tensor.data_type != TensorProto.STRING:
            add_array(self, tensor, np.array(value, copy=True) if copy else value)
        else:
            set_initializer(tensor, value)

    def remeasured(self) -> LargeModel:
        """This model, large from now on if its tensors grew past
        :func:`.tensors.large_model_bytes` (a large model stays large)."""
        self.large = self.large or self.nbytes > large_model_bytes()
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor's values, detached or not."""
        return sum(tensor_nbytes(t) for t in all_tensors(self.model_proto))

    def to_proto(self) -> onnx.ModelProto:
        """A ModelProto holding every tensor (for small models): the message itself when no
        tensor is detached, else a copy of it with the arrays' values."""
        return whole_proto(self)

    def public(self, checksums: bool = False) -> onnx.ModelProto | LargeModel:
        """What a public function returns for this model, which it hands over: itself when
        large, else its message holding every tensor (the arrays' values moved into it, no
        copy of the message), with its checksum record if ``checksums`` (a large model gets
        its checksums as it is written)."""
        if self.large:
            return self
        proto = self.model_proto
        for tensor in all_tensors(proto):
            name = location(tensor)
            if name is not None and name in self.large_initializers:
                value = np.asarray(self.large_initializers[name], order="C")  # keeps 0-d
                tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
        self.large_initializers = {}
        return add_checksums(proto) if checksums else proto

    def write(self, path, checksums: bool | None = None) -> str:
        """Write the model to ``path`` atomically (:func:`.save.save_model`): one file when
        small, the message plus one data file when large; returns the path."""
        return save_model(self, path, external=self.large, checksums=checksums)

    def save(self, file_path: str, all_tensors_to_one_file: bool = True) -> onnx.ModelProto:  # noqa: ARG002
        """Write the model atomically, its tensors in one external data file beside it
        (:func:`.save.save_model`; onnx's own ``save`` would miss the training_info graphs'
        tensors); returns the message."""
        save_model(self, file_path, external=True)
        return self.model_proto


def detach(model: onnx.ModelProto | LargeModel, min_bytes: int = MIN_DETACHED_BYTES) -> LargeModel:
    """``model`` as a LargeModel whose initializers of ``min_bytes`` or more (main and
    training_info graphs) are arrays. A ModelProto is consumed (its tensors' values move
    out of it); a malformed tensor stays in the message, for its reader to name."""
    out = model if isinstance(model, LargeModel) else LargeModel(model)
    moved = 0
    for graph in graphs_with_tensors(out.model_proto):
        for tensor in graph.initializer:
            if location(tensor) is None and tensor_nbytes(tensor) >= min_bytes \
                    and tensor.data_type != TensorProto.STRING:
                try:
                    value = numpy_helper.to_array(tensor)
                except (ValueError, TypeError):
                    continue
                add_array(out, tensor, _zeros_as_view(value))
                moved += value.nbytes
    if moved:  # protobuf frees a cleared field's bytes only with the whole message: a fresh one holds none
        fresh = onnx.ModelProto()
        fresh.CopyFrom(out.model_proto)
        out.model_proto = fresh
    return out


def _zeros_as_view(value: np.ndarray) -> np.ndarray:
    """``value``, or if every byte of it is 0 (a fresh optimizer state, a zero bias) a
    :func:`.tensors.constant_array` of zeros, which takes no memory."""
    if value.size > 1 and not np.ascontiguousarray(value).reshape(-1).view(np.uint8).any():
        return constant_array(0, value.dtype, value.shape)
    return value
