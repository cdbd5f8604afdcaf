"""Checkpoints: a training model with the current state as its initializers, written atomically.

A checkpoint is nothing but an ONNX training model (``ModelProto`` with ``training_info``)
whose initializers hold the current values of every state variable (parameters, optimizer
state V/H, update count T). Loading it with :class:`~onnx_training_ops.TrainingSession`
resumes bit for bit: initializers are stored as raw little-endian bytes, the exact values.

:func:`atomic_write` writes to a temporary file in the target's directory, flushes and
fsyncs it, then ``os.replace``-s it over the target (and fsyncs the directory): a reader
sees the old file or the new one, never a torn one, even when the process dies mid-write.
Temporary files left by a writer that died (or by this process's own interrupted write) are
removed by the next save to the same path, and only those: a save to ``ck.onnx`` never touches
the temporary of a concurrent save to ``ck.onnx.bak``.

**Integrity**: :func:`write_state` stores SHA-256 checksums of every initializer and of the
rest of the model in ``metadata_props`` (``onnx_training_ops.checksums``); :func:`verify`
(run by TrainingSession on load) names the first tensor that no longer matches. A checkpoint
without checksums (written before they existed) loads unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from typing import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import FileWriteError, TrainingOpError
from ..interrupts import held_interrupts

CHECKSUM_KEY = "onnx_training_ops.checksums"


# The temporary file of a write to ``name``: ``.<name>.<pid>.<random>.tmp`` (random from
# mkstemp: letters, digits, underscores). Matched exactly, so a save to ``ck.onnx`` never takes
# the temporary of a save to ``ck.onnx.bak`` (``.ck.onnx.bak.<pid>...``) for its own.
_TEMPORARY = r"(\d+)\.[A-Za-z0-9_]+\.tmp"
_IN_FLIGHT: set[str] = set()  # this process's temporaries being written (any thread)
_IN_FLIGHT_LOCK = threading.Lock()


def _forked() -> None:
    """A forked child writes none of its parent's temporaries, and starts with the lock free."""
    global _IN_FLIGHT_LOCK
    _IN_FLIGHT.clear()
    _IN_FLIGHT_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def atomic_write(path: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically (temp file + fsync + os.replace); returns the path.

    A Ctrl-C (or any error) while writing removes the temporary; its creation and
    registration are one Ctrl-C-held step, so none is ever left behind unnamed. An OSError
    is a TrainingOpError naming ``path``, not the temporary."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}."
    tmp, fd = None, None
    try:
        os.makedirs(directory, exist_ok=True)
        _remove_stale_temporaries(directory, prefix)
        with held_interrupts():
            fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}.", suffix=".tmp", dir=directory)
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.add(tmp)
        f, fd = os.fdopen(fd, "wb"), None
        _write_and_rename(f, tmp, path, data)
    except BaseException as error:
        if fd is not None:
            os.close(fd)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(error, OSError):
            raise FileWriteError(f"cannot write {path!r}: {error.strerror or error}") from error
        raise
    finally:
        if tmp is not None:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(tmp)
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # pragma: no cover - platforms without directory fsync
        pass
    return path


def _write_and_rename(f, tmp: str, path: str, data: bytes) -> None:
    with f:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(f.fileno(), 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_stale_temporaries(directory: str, prefix: str) -> None:
    """Delete the temporaries of writes to this very name (``<prefix><pid>.<random>.tmp``)
    whose writer is gone: another process that no longer exists, or this one, when no
    thread is writing it (a write cut short, e.g. by an error while it was being created)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    pattern = re.compile(re.escape(prefix) + _TEMPORARY)
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        pid, full = int(match.group(1)), os.path.join(directory, name)
        if pid == os.getpid():
            with _IN_FLIGHT_LOCK:
                if full in _IN_FLIGHT:
                    continue
        elif _alive(pid):
            continue
        try:
            os.unlink(full)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    graphs = [model.graph]
    for info in model.training_info:
        graphs += [info.initialization, info.algorithm]
    return graphs


def checksums(model: onnx.ModelProto) -> dict:
    """SHA-256 of every initializer (by name) and of the model without them."""
    tensors = {}
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    kept = [m for m in skeleton.metadata_props if m.key != CHECKSUM_KEY]
    del skeleton.metadata_props[:]
    skeleton.metadata_props.extend(kept)
    for graph in _graphs(model):
        for tensor in graph.initializer:
            tensors[tensor.name] = hashlib.sha256(tensor.SerializeToString()).hexdigest()
    for graph in _graphs(skeleton):
        del graph.initializer[:]
    return {"tensors": tensors,
            "model": hashlib.sha256(skeleton.SerializeToString()).hexdigest()}


def add_checksums(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (in place) with its checksums in metadata_props."""
    kept = [m for m in model.metadata_props if m.key != CHECKSUM_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=CHECKSUM_KEY, value=json.dumps(checksums(model)))
    return model


def verify(model: onnx.ModelProto, path=None) -> None:
    """Raise TrainingOpError naming the file and the first tensor that does not match the
    stored checksums (nothing to check when there are none)."""
    stored = next((m.value for m in model.metadata_props if m.key == CHECKSUM_KEY), None)
    if stored is None:
        return
    where = f"checkpoint {os.fspath(path)!r}" if path is not None else "the model"
    try:
        expected = json.loads(stored)
        want_tensors, want_model = dict(expected["tensors"]), expected["model"]
    except (ValueError, KeyError, TypeError):
        raise TrainingOpError(f"{where}: its checksum record is damaged") from None
    got = checksums(model)
    for name, digest in got["tensors"].items():
        if want_tensors.pop(name, None) != digest:
            raise TrainingOpError(f"{where}: tensor {name!r} does not match its checksum: the "
                                  "file is damaged (restore it from a copy)")
    if want_tensors:
        raise TrainingOpError(f"{where}: tensor(s) {sorted(want_tensors)} are missing")
    if got["model"] != want_model:
        raise TrainingOpError(f"{where}: the graph (not a tensor) does not match its checksum: "
                              "the file is damaged")


def set_initializer(tensor: onnx.TensorProto, value: np.ndarray) -> None:
    """Overwrite ``tensor`` (in place, keeping its name) with ``value``'s exact bytes."""
    name = tensor.name
    tensor.CopyFrom(numpy_helper.from_array(np.array(value, order="C", copy=True), name))  # keeps 0-d


def write_state(model: onnx.ModelProto, state: Mapping[str, np.ndarray],
                metadata: Mapping[str, str] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``state`` (main graph and training_info
    algorithm graphs) hold the given values, with ``metadata`` entries set (an empty value
    removes the key)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if metadata:
        kept = [m for m in out.metadata_props if m.key not in metadata]
        del out.metadata_props[:]
        out.metadata_props.extend(kept)
        out.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=v)
                                  for k, v in metadata.items() if v)
    graphs = [out.graph] + [info.algorithm for info in out.training_info]
    for graph in graphs:
        for tensor in graph.initializer:
            if tensor.name in state:
                set_initializer(tensor, state[tensor.name])
    return add_checksums(out)


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> str:
    """Serialize ``model`` to ``path`` atomically."""
    return atomic_write(path, model.SerializeToString())
