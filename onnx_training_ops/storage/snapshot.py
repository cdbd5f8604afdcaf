"""A training model holding given state values: what a checkpoint or a snapshot writes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from .checkpoint import CHECKSUM_KEY
from .large_model import LargeModel


def write_state(model: LargeModel, state: Mapping[str, np.ndarray],
                metadata: Mapping[str, str] | None = None, copy: bool = True) -> LargeModel:
    """A copy of ``model`` whose initializers named in ``state`` (main graph and training_info
    algorithm graphs) hold the given values, with ``metadata`` entries set (an empty value
    removes the key). Big values are arrays: copies of ``state``'s, or with ``copy=False`` the
    very arrays (for a writer that holds them still). An earlier checksum record is dropped
    (stale): checksums are computed when the copy is written or made public
    (:meth:`.large_model.LargeModel.public` with ``checksums=True``). The copy is large if
    ``model`` is or if its tensors now pass the size limit."""
    out = model.copy()
    proto = out.model_proto
    metadata = {**(metadata or {}), CHECKSUM_KEY: ""}
    kept = [m for m in proto.metadata_props if m.key not in metadata]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    proto.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=v) for k, v in metadata.items() if v)
    graphs = [proto.graph] + [info.algorithm for info in proto.training_info]
    for graph in graphs:
        for tensor in graph.initializer:
            if tensor.name in state:
                out.set_value(tensor, state[tensor.name], copy=copy)
    return out.with_proto(proto).remeasured()
