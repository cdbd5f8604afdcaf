"""The builder's record in a training model: ``metadata_props`` under the ``onnx_training_ops.`` prefix.

The builder writes the optimizer (JSON), loss, labels, learning rate, trainables, mode... ;
TrainingSession, sharding and export read them back with :func:`metadata`.
"""

from __future__ import annotations

import onnx

META_PREFIX = "onnx_training_ops."


def metadata(model: onnx.ModelProto) -> dict[str, str]:
    """The builder's metadata of ``model`` (keys without the ``onnx_training_ops.`` prefix)."""
    return {m.key[len(META_PREFIX):]: m.value for m in model.metadata_props if m.key.startswith(META_PREFIX)}


def set_metadata(model: onnx.ModelProto, meta: dict[str, str]) -> None:
    """Replace the builder's entries of ``model`` (in place) by ``meta``."""
    kept = [m for m in model.metadata_props if not m.key.startswith(META_PREFIX)]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in meta.items():
        model.metadata_props.add(key=META_PREFIX + key, value=value)
