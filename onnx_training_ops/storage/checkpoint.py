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

**Integrity**: :func:`.snapshot.write_state` stores SHA-256 checksums of every initializer and of the
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
from collections.abc import Callable, Mapping
from typing import BinaryIO

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.model_container import ModelContainer

from ..errors import FileWriteError, TrainingOpError
from ..interrupts import held_interrupts
from .external_data import digest
from .tensors import array_of, location, proto_of

CHECKSUM_KEY = "onnx_training_ops.checksums"


# The temporary file of a write to ``name``: ``.<name>.<pid>.<thread>.<random>.tmp`` (random
# from mkstemp: letters, digits, underscores; older versions wrote no thread id). Matched
# exactly, so a save to ``ck.onnx`` never takes the temporary of a save to ``ck.onnx.bak``
# (``.ck.onnx.bak.<pid>...``) for its own.
_TEMPORARY = r"(\d+)\.(?:\d+\.)?[A-Za-z0-9_]+\.tmp"
_IN_FLIGHT: set[str] = set()  # this process's temporaries being written (any thread)
_IN_FLIGHT_LOCK = threading.Lock()


def _forked() -> None:
    """A forked child writes none of its parent's temporaries, and starts with the lock free."""
    global _IN_FLIGHT_LOCK
    _IN_FLIGHT.clear()
    _IN_FLIGHT_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object],
                 final_path: Callable[[], str] | None = None) -> str:
    """Write ``data`` to ``path`` atomically (temp file + fsync + os.replace); returns the path.
    ``data``: bytes, or a function that writes to the open file (streamed, never joined in
    memory). ``final_path``: asked once the file is written (a name that depends on what
    was written): the file goes there instead of ``path``.

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
        # created and registered under the lock: another thread's stale-temporary sweep (which
        # checks _IN_FLIGHT under it) never sees this one unregistered and removes it
        with held_interrupts(), _IN_FLIGHT_LOCK:
            fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}.{threading.get_native_id()}.",
                                       suffix=".tmp", dir=directory)
            _IN_FLIGHT.add(tmp)
        f, fd = os.fdopen(fd, "wb"), None
        path = _write_and_rename(f, tmp, path, data, final_path)
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


def _write_and_rename(f, tmp: str, path: str, data, final_path) -> str:
    with f:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(f.fileno(), 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        data(f) if callable(data) else f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if final_path is not None:
        path = final_path()
    os.replace(tmp, path)
    return path


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


def header_digest(tensor: onnx.TensorProto) -> str:
    """SHA-256 of what a tensor stored as external data keeps in the message: name, type, dims."""
    header = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type)
    header.dims.extend(tensor.dims)
    return hashlib.sha256(header.SerializeToString()).hexdigest()


def checksums(model: onnx.ModelProto | ModelContainer, data: Mapping[str, str] | None = None) -> dict:
    """SHA-256 of every initializer (by name) and of the model without them. A tensor whose
    values are outside the message (a LargeModel's array, external data) gets the digest of
    its header (:func:`header_digest`) under ``tensors`` and of its values under ``data``
    (``data[name]`` when given: computed while they were written)."""
    proto = proto_of(model)
    tensors, values = {}, {}
    for graph in _graphs(proto):
        for tensor in graph.initializer:
            if location(tensor) is None:
                tensors[tensor.name] = hashlib.sha256(tensor.SerializeToString()).hexdigest()
                continue
            tensors[tensor.name] = header_digest(tensor)
            values[tensor.name] = data[tensor.name] if data and tensor.name in data else \
                digest(array_of(model, tensor))
    out = {"tensors": tensors, "model": _skeleton_digest(proto)}
    if values:
        out["data"] = values
    return out


def _skeleton_digest(model: onnx.ModelProto) -> str:
    """SHA-256 of the model without its initializers and its checksum record (a copy of the
    message: small for a LargeModel, whose big tensors are outside it)."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    kept = [m for m in skeleton.metadata_props if m.key != CHECKSUM_KEY]
    del skeleton.metadata_props[:]
    skeleton.metadata_props.extend(kept)
    for graph in _graphs(skeleton):
        del graph.initializer[:]
    return hashlib.sha256(skeleton.SerializeToString()).hexdigest()


def add_checksums(model: onnx.ModelProto | ModelContainer, data: Mapping[str, str] | None = None):
    """``model`` (in place) with its checksums in metadata_props (``data``: see :func:`checksums`)."""
    proto = proto_of(model)
    record = json.dumps(checksums(model, data))
    kept = [m for m in proto.metadata_props if m.key != CHECKSUM_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    proto.metadata_props.add(key=CHECKSUM_KEY, value=record)
    return model


def stored_checksums(model: onnx.ModelProto | ModelContainer, where: str = "the model") -> dict | None:
    """The checksum record of ``model`` (None when it has none)."""
    stored = next((m.value for m in proto_of(model).metadata_props if m.key == CHECKSUM_KEY), None)
    if stored is None:
        return None
    try:
        record = json.loads(stored)
        return {"tensors": dict(record["tensors"]), "model": record["model"], "data": dict(record.get("data", {}))}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TrainingOpError(f"{where}: its checksum record is damaged") from None


def verify(model: onnx.ModelProto | ModelContainer, path=None, data: bool = True) -> dict[str, str]:
    """Raise TrainingOpError naming the file and the first tensor that does not match the
    stored checksums (nothing to check when there are none). ``data=False`` leaves the
    values of tensors outside the message unchecked and returns their expected digests
    (name -> SHA-256), for a reader that hashes them as it reads them (a TrainingSession
    loading a checkpoint reads each tensor once)."""
    where = f"checkpoint {os.fspath(path)!r}" if path is not None else "the model"
    expected = stored_checksums(model, where)
    if expected is None:
        return {}
    proto = proto_of(model)
    want_tensors, want_data = expected["tensors"], expected["data"]
    unchecked = {}
    for graph in _graphs(proto):
        for tensor in graph.initializer:
            name = tensor.name
            if name in want_data:  # saved as external data: header and values apart
                got = header_digest(tensor)
                if location(tensor) is None:
                    values_ok = digest(numpy_helper.to_array(tensor)) == want_data[name]
                elif data:
                    values_ok = digest(array_of(model, tensor)) == want_data[name]
                else:
                    values_ok, unchecked[name] = True, want_data[name]
            else:
                got, values_ok = hashlib.sha256(tensor.SerializeToString()).hexdigest(), True
            if want_tensors.pop(name, None) != got or not values_ok:
                raise damaged(where, name)
    if want_tensors:
        raise TrainingOpError(f"{where}: tensor(s) {sorted(want_tensors)} are missing")
    if _skeleton_digest(proto) != expected["model"]:
        raise TrainingOpError(f"{where}: the graph (not a tensor) does not match its checksum: "
                              "the file is damaged")
    return unchecked


def damaged(where: str, name: str) -> TrainingOpError:
    """The error for a tensor whose bytes do not match their checksum."""
    return TrainingOpError(f"{where}: tensor {name!r} does not match its checksum: the "
                           "file is damaged (restore it from a copy)")


def set_initializer(tensor: onnx.TensorProto, value: np.ndarray) -> None:
    """Overwrite ``tensor`` (in place, keeping its name) with ``value``'s exact bytes."""
    name = tensor.name
    tensor.CopyFrom(numpy_helper.from_array(np.array(value, order="C", copy=True), name))  # keeps 0-d
