"""Checkpoints: a training model with the current state as its initializers, written atomically.

A checkpoint is nothing but an ONNX training model (``ModelProto`` with ``training_info``)
whose initializers hold the current values of every state variable (parameters, optimizer
state V/H, update count T). Loading it with :class:`~onnx_training_ops.TrainingSession`
resumes bit for bit: initializers are stored as raw little-endian bytes, the exact values.

:func:`atomic_write` writes to a temporary file in the target's directory, flushes and
fsyncs it, then ``os.replace``-s it over the target (and fsyncs the directory): a reader
sees the old file or the new one, never a torn one, even when the process dies mid-write.
"""

from __future__ import annotations

import os
import tempfile
from typing import Mapping

import numpy as np
import onnx
from onnx import numpy_helper


def atomic_write(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (temp file + fsync + os.replace); returns the path."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # pragma: no cover - platforms without directory fsync
        pass
    return path


def set_initializer(tensor: onnx.TensorProto, value: np.ndarray) -> None:
    """Overwrite ``tensor`` (in place, keeping its name) with ``value``'s exact bytes."""
    name = tensor.name
    tensor.CopyFrom(numpy_helper.from_array(np.array(value, order="C", copy=True), name))  # keeps 0-d


def write_state(model: onnx.ModelProto, state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``state`` (main graph and training_info
    algorithm graphs) hold the given values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graphs = [out.graph] + [info.algorithm for info in out.training_info]
    for graph in graphs:
        for tensor in graph.initializer:
            if tensor.name in state:
                set_initializer(tensor, state[tensor.name])
    return out


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> str:
    """Serialize ``model`` to ``path`` atomically."""
    return atomic_write(path, model.SerializeToString())
