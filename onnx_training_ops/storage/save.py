"""Writing a model to disk atomically, with its big tensors in an external data file when it is large.

A model up to :func:`.large_model.large_model_bytes` is one ``.onnx`` file written by
:func:`.checkpoint.atomic_write`. A larger one (or a :class:`.large_model.LargeModel`) is
two files, in onnx's external-data format: the message (``model.onnx``, small) and one data
file beside it holding every tensor of :data:`.large_model.MIN_DETACHED_BYTES` or more,
page-aligned, named after its contents: ``model.onnx.<16 hex digits>.data``. The arrays are
streamed into the file (never joined into one bytes object), each hashed on the way
(SHA-256: the checkpoint's ``data`` checksums).

**Atomic, across two files.** The data file is written under a temporary name, fsynced and
renamed to its final, new name (no reader knows it yet); then the message, which names it,
replaces the old one atomically (:func:`.checkpoint.atomic_write`): that rename is the
commit. Only then is the data file of the previous version removed. A crash before the
commit leaves the old checkpoint whole (plus an orphan the next save removes); after it,
the new one. A reader opening the message gets a version whose data file exists, except in
the instant between reading an old message and opening its data file while a writer
commits: :func:`.model_files.load_model` then reads the message again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    _FLOCK = False  # and ``fcntl`` unbound: _directory_lock checks _FLOCK first
else:
    _FLOCK = True

import onnx
from onnx import numpy_helper
from onnx.model_container import ModelContainer

from .checkpoint import add_checksums, atomic_write, stored_checksums
from .external_data import write_tensors
from .tensors import (
    MIN_DETACHED_BYTES,
    array_of,
    attach,
    graphs_with_tensors,
    large_model_bytes,
    location,
    proto_of,
    set_location,
    tensor_nbytes,
)

_DATA_NAME = re.compile(r"\.[0-9a-f]{16}\.data$")


def save_model(model: onnx.ModelProto | ModelContainer, path: str | os.PathLike, external: bool | None = None,
               checksums: bool | None = None) -> str:
    """Write ``model`` to ``path`` atomically; returns the path. ``external``: tensors in a
    data file beside it (default: for a LargeModel, or a message past
    :func:`.large_model.large_model_bytes`). ``checksums``: write the checksum record
    (:mod:`.checkpoint`; default: when the model has one, brought up to date)."""
    path = os.fspath(path)
    if checksums is None:
        checksums = stored_checksums(proto_of(model)) is not None
    if external is None:
        external = isinstance(model, ModelContainer) or model.ByteSize() > large_model_bytes()
    if external:
        return _save_external(model, path, checksums)
    proto = model if isinstance(model, onnx.ModelProto) else attach(model)
    if checksums and (proto is not model or stored_checksums(proto) is None):
        add_checksums(proto)
    return atomic_write(path, proto.SerializeToString())


def data_files(path: str) -> list[str]:
    """The data files this package wrote for ``path`` (``<name>.<16 hex>.data`` beside it)."""
    directory, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names
                  if n.startswith(base + ".") and _DATA_NAME.search(n[len(base):]))


@contextlib.contextmanager
def _directory_lock(directory: str):
    """An exclusive lock on ``directory`` (``flock``; processes and threads alike), where the
    platform has one: two writers of external data there never remove each other's data file."""
    if not _FLOCK:  # pragma: no cover - Windows
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _save_external(model: onnx.ModelProto | ModelContainer, path: str, checksums: bool) -> str:
    directory, base = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # One writer at a time from the data file to the removal of the old ones: a concurrent save to
    # the same path would otherwise remove the data file this one is about to commit.
    with _directory_lock(directory):
        return _save_external_locked(model, path, directory, base, checksums)


def _holds_values(tensor: onnx.TensorProto) -> bool:
    """False for a tensor with dims and no values (a nominal checkpoint's): it stays in the message."""
    return tensor.HasField("raw_data") or any(
        len(getattr(tensor, f)) for f in ("float_data", "double_data", "int32_data", "int64_data",
                                         "uint64_data", "string_data"))


def _save_external_locked(model: onnx.ModelProto | ModelContainer, path: str, directory: str, base: str,
                          checksums: bool) -> str:
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(proto_of(model))
    tensors = [t for g in graphs_with_tensors(skeleton) for t in g.initializer
               if location(t) is not None or (tensor_nbytes(t) >= MIN_DETACHED_BYTES and _holds_values(t))]
    # one tensor's values at a time (a message's tensors are copied out as they are written)
    arrays = ((i, array_of(model, t) if location(t) is not None else numpy_helper.to_array(t))
              for i, t in enumerate(tensors))
    written: dict = {}

    def data_file() -> str:  # named after its contents: a new version never overwrites the old
        whole = hashlib.sha256("".join(d for _, _, d in written.values()).encode()).hexdigest()
        return os.path.join(directory, f"{base}.{whole[:16]}.data")

    data_name = os.path.basename(atomic_write(path, lambda f: written.update(write_tensors(f, arrays)),
                                              final_path=data_file))
    data = {}
    for i, tensor in enumerate(tensors):
        offset, length, digest = written[i]
        set_location(tensor, data_name, offset, length)
        data[tensor.name] = digest
    if checksums:
        add_checksums(skeleton, data)
    atomic_write(path, skeleton.SerializeToString())  # the commit
    keep = os.path.join(directory, data_name)
    for old in data_files(path):
        if old != keep:
            try:
                os.unlink(old)
            except OSError:
                pass
    return path
