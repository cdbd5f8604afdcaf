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
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.model_container import ModelContainer

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
)


class LargeModel(ModelContainer):
    """A ModelProto (``model_proto``) and its big tensors (``large_initializers``, by ``#key``)."""

    def __init__(self, model_proto: onnx.ModelProto | None = None,
                 arrays: Mapping[str, np.ndarray] | None = None) -> None:
        super().__init__()
        if model_proto is not None:
            self.model_proto = model_proto
        self.large_initializers = dict(arrays or {})

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The values of any tensor of this model: its array if detached, else parsed from
        the message."""
        return tensor_value(tensor, self.large_initializers)

    def copy(self) -> LargeModel:
        """Another LargeModel over a copy of the message and the same (immutable) arrays."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self.model_proto)
        return LargeModel(proto, self.large_initializers)

    def with_proto(self, model_proto: onnx.ModelProto) -> LargeModel:
        """``model_proto`` (derived from this model's, e.g. by a pass) with this model's arrays,
        keeping only those it still refers to."""
        used = {location(t) for t in all_tensors(model_proto)}
        return LargeModel(model_proto, {k: v for k, v in self.large_initializers.items() if k in used})

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor's values, detached or not."""
        return sum(tensor_nbytes(t) for t in all_tensors(self.model_proto))

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
    for graph in graphs_with_tensors(out.model_proto):
        for tensor in graph.initializer:
            if location(tensor) is None and tensor_nbytes(tensor) >= min_bytes \
                    and tensor.data_type != TensorProto.STRING:
                try:
                    value = numpy_helper.to_array(tensor)
                except (ValueError, TypeError):
                    continue
                add_array(out, tensor, _zeros_as_view(value))
    return out


def _zeros_as_view(value: np.ndarray) -> np.ndarray:
    """``value``, or if every byte of it is 0 (a fresh optimizer state, a zero bias) a
    :func:`.tensors.constant_array` of zeros, which takes no memory."""
    if value.size > 1 and not np.ascontiguousarray(value).reshape(-1).view(np.uint8).any():
        return constant_array(0, value.dtype, value.shape)
    return value


def is_large(model: onnx.ModelProto | LargeModel) -> bool:
    """A LargeModel with detached tensors, or a message past :func:`.tensors.large_model_bytes`."""
    if isinstance(model, LargeModel):
        return bool(model.large_initializers) or model.nbytes > large_model_bytes()
    return model.ByteSize() > large_model_bytes()
