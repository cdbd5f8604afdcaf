"""A training model holding given state values: what a checkpoint or a snapshot writes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from .checkpoint import add_checksums, set_initializer
from .large_model import LargeModel
from .tensors import MIN_DETACHED_BYTES, add_array, proto_of, tensor_nbytes


def write_state(model: onnx.ModelProto | LargeModel, state: Mapping[str, np.ndarray],
                metadata: Mapping[str, str] | None = None, copy: bool = True) -> onnx.ModelProto | LargeModel:
    """A copy of ``model`` whose initializers named in ``state`` (main graph and training_info
    algorithm graphs) hold the given values, with ``metadata`` entries set (an empty value
    removes the key). A ModelProto gets its checksums. A LargeModel keeps the values as
    arrays: copies of ``state``'s, or with ``copy=False`` the very arrays (for a writer that
    holds them still); its checksums are computed when it is saved, as its bytes are written."""
    large = isinstance(model, LargeModel)
    out = model.copy() if large else onnx.ModelProto()
    if not large:
        out.CopyFrom(model)
    proto = proto_of(out)
    if metadata:
        kept = [m for m in proto.metadata_props if m.key not in metadata]
        del proto.metadata_props[:]
        proto.metadata_props.extend(kept)
        proto.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=v)
                                    for k, v in metadata.items() if v)
    graphs = [proto.graph] + [info.algorithm for info in proto.training_info]
    for graph in graphs:
        for tensor in graph.initializer:
            if tensor.name not in state:
                continue
            if large and tensor_nbytes(tensor) >= MIN_DETACHED_BYTES:
                add_array(out, tensor, np.array(state[tensor.name], copy=True) if copy else state[tensor.name])
            else:
                set_initializer(tensor, state[tensor.name])
    return out.with_proto(proto) if large else add_checksums(out)
