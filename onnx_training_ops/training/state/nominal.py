"""Nominal checkpoints: the training model with names, dtypes and shapes but no values.

onnxruntime-training's ``nominal_checkpoint`` ships a model to a device that fills in the
parameters it receives (``copy_buffer_to_parameters``). Here :func:`nominal_model` empties
every state variable (parameters, optimizer state, T) and every other parameter (frozen
float initializers of rank >= 1) of a training model and lists them in the metadata
(``onnx_training_ops.nominal``); the file keeps the graphs and each tensor's dims and dtype.
:func:`materialize` turns such a model back into one with zeros in those tensors, which a
session opens, initializes (optimizer state at its initial values) and refuses to train until
the parameters are loaded (``load_flat_parameters`` / ``load_state_dict``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...builder import META_PREFIX
from ...builder.metadata import TrainingMetadata
from ...storage.checkpoint import add_checksums

KEY = "nominal"  # metadata key (under META_PREFIX): JSON list of the emptied tensors


def _initializers(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    yield from model.graph.initializer
    for info in model.training_info:
        yield from info.algorithm.initializer


def nominal_model(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers ``names`` keep name, dims and dtype, no data."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = list(dict.fromkeys(names))
    wanted = set(names)
    for tensor in _initializers(out):
        if tensor.name in wanted:
            empty = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
            tensor.CopyFrom(empty)
    kept = [m for m in out.metadata_props if m.key != META_PREFIX + KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(kept)
    out.metadata_props.add(key=META_PREFIX + KEY, value=json.dumps(names))
    return add_checksums(out)


def nominal_names(meta: TrainingMetadata) -> list[str]:
    """The tensors a nominal model left empty (``[]`` for a complete model)."""
    return list(meta.nominal)


def materialize(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the nominal ``model`` with zeros in its empty tensors and no nominal mark."""
    empty = set(nominal_names(TrainingMetadata.from_model(model)))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in _initializers(out):
        if tensor.name in empty:
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            tensor.CopyFrom(numpy_helper.from_array(np.zeros(tuple(tensor.dims), dtype), tensor.name))
    kept = [m for m in out.metadata_props if m.key != META_PREFIX + KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(kept)
    return add_checksums(out)
