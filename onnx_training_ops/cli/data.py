"""Data files for ``onnx-training-ops train``: columns by name, matched to the model's inputs.

* ``.npz`` and ``.safetensors``: one array per input, keyed by the input's name
  (``input``, ``labels``...), first axis the samples.
* ``.csv``: a header row names the columns. A column named as an input is that input (one
  value per sample); columns ``NAME[0]``, ``NAME[1]``... are the flattened values of input
  ``NAME`` per sample (C order), reshaped to the input's per-sample shape when the model
  fixes it. The label input (``labels``/``target``) may go unnamed: then it is the last
  column. Values are parsed as numbers. The text is UTF-8 (a byte-order mark allowed).

Each array is cast to its input's element type when that loses no kind (integers to int64,
floats to float32...); a float column for an integer input is refused.
"""

from __future__ import annotations

import codecs
import csv
import io
import os
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..errors import TrainingOpError

_ELEMENT = re.compile(r"^(.*)\[(\d+)\]$")


def read_table(path: str) -> Callable[[str | None], dict[str, np.ndarray]]:
    """The arrays of a ``.npz``, ``.safetensors`` or ``.csv`` file, in two steps: the file read and
    checked now (every error but those about names), its columns named by the returned function
    once the label input's name is known (the training model's metadata; a csv without that
    column gives it its last column): ``read_table(path)(label)`` -> ``{name: array}``, samples on
    the first axis. The ``train`` command reads its data so, before it opens a session (which may
    compile kernels for a minute on a first run).

    Raises:
        TrainingOpError: a missing or unreadable file, an unknown extension, a bad header or value.
    """
    if not os.path.isfile(path):
        raise TrainingOpError(f"data file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".npz":
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            return lambda label: arrays
        if ext == ".safetensors":
            from ..storage.safetensors import read

            tensors = dict(read(path)[0])
            return lambda label: tensors
    except TrainingOpError:
        raise
    except Exception as error:  # noqa: BLE001 - a damaged file, told in one line
        raise TrainingOpError(f"data file {path!r}: cannot read it as {ext[1:]}: {error}") from error
    if ext == ".csv":
        header, values = _parse_csv(path)
        return lambda label: _csv_columns(path, header, values, label)
    raise TrainingOpError(f"data file {path!r}: expected .npz, .safetensors or .csv, found {ext or 'no extension'!r}")


def _text(path: str) -> str:
    """The file as UTF-8 text (a byte-order mark allowed); anything else is refused in one line."""
    with open(path, "rb") as f:
        raw = f.read()
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if raw.startswith(bom):
            raise TrainingOpError(f"data file {path!r} is {name} text: save it as UTF-8 (CSV UTF-8)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise TrainingOpError(f"data file {path!r} is not UTF-8 text (byte 0x{raw[error.start]:02x} on line {line}): "
                              "save it as UTF-8 (CSV UTF-8)") from None
    if "\0" in text:
        raise TrainingOpError(f"data file {path!r} holds NUL bytes: expected CSV text")
    return text


def _parse_csv(path: str) -> tuple[list[str], np.ndarray]:
    """A CSV file's header and its values as float64 rows, checked."""
    try:
        rows = list(csv.reader(io.StringIO(_text(path), newline="")))
    except csv.Error as error:
        raise TrainingOpError(f"data file {path!r}: not a CSV file: {error}") from None
    if not rows or not rows[0]:
        raise TrainingOpError(f"data file {path!r}: expected a header row naming the columns, found an empty file")
    header, body = [h.strip() for h in rows[0]], rows[1:]
    if not body:
        raise TrainingOpError(f"data file {path!r}: no rows after the header")
    try:
        values = np.array([[float(v) for v in row] for row in body], dtype=np.float64)
    except ValueError as error:
        raise TrainingOpError(f"data file {path!r}: every value must be a number: {error}") from error
    if values.ndim != 2 or values.shape[1] != len(header):
        bad = next(i for i, row in enumerate(body) if len(row) != len(header))
        raise TrainingOpError(f"data file {path!r}: row {bad + 2} has {len(body[bad])} values, the header "
                              f"{len(header)}")
    return header, values


def _csv_columns(path: str, header: list[str], values: np.ndarray, label: str | None) -> dict[str, np.ndarray]:
    """The columns of a parsed CSV by name (``name[i]`` columns gathered; the label column last, unnamed)."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for column, name in enumerate(header):
        match = _ELEMENT.match(name)
        base, index = (match.group(1), int(match.group(2))) if match else (name, -1)
        groups.setdefault(base, []).append((index, column))
    if label is not None and label not in groups:  # the label column last, unnamed
        last = header[-1]
        base = element.group(1) if (element := _ELEMENT.match(last)) else last
        groups[base] = [p for p in groups[base] if p[1] != len(header) - 1]
        if not groups[base]:
            del groups[base]
        groups[label] = [(-1, len(header) - 1)]
    out = {}
    for name, parts in groups.items():
        if len(parts) == 1 and parts[0][0] == -1:
            out[name] = values[:, parts[0][1]]
            continue
        indices = sorted(i for i, _ in parts)
        if indices != list(range(len(parts))):
            raise TrainingOpError(f"data file {path!r}: columns of {name!r} must be "
                                  f"{name}[0]..{name}[{len(parts) - 1}] "
                                  f"once each, found indices {indices}")
        out[name] = values[:, [c for _, c in sorted(parts)]]
    return out


def match_feeds(columns: Mapping[str, np.ndarray], feeds: Sequence, where: str) -> dict[str, np.ndarray]:
    """``columns`` as the feeds of ``feeds`` (:class:`~onnx_training_ops.training.inputs.feeds.Feed`): cast, reshaped.

    Args:
        columns: arrays by name (:func:`read_table`).
        feeds: the model's inputs for this use (required ones must all be there).
        where: the file, for messages.

    Returns:
        ``{input name: array}``, every array with the same number of samples.

    Raises:
        TrainingOpError: a required input missing, a column no input takes, a dtype or
            shape that does not fit, differing sample counts.
    """
    by_name = {f.name: f for f in feeds}
    unknown = sorted(set(columns) - set(by_name))
    if unknown:
        raise TrainingOpError(f"{where}: {', '.join(map(repr, unknown))} is not an input of the model; "
                              f"inputs: {', '.join(by_name)}")
    missing = [f.name for f in feeds if not f.optional and f.name not in columns]
    if missing:
        raise TrainingOpError(f"{where}: no data for input(s) {', '.join(map(repr, missing))}; "
                              f"found {', '.join(map(repr, columns)) or 'nothing'}")
    out = {}
    for name, array in columns.items():
        feed, array = by_name[name], np.asarray(array)
        want = np.dtype(feed.dtype)
        if array.dtype != want:
            if want.kind in "iu" and array.dtype.kind == "f":
                if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
                    raise TrainingOpError(f"{where}: input {name!r} is {want.name} and its data holds non-integers")
            elif want.kind != array.dtype.kind and not (want.kind in "iu" and array.dtype.kind in "iub") \
                    and not (want.kind == "f" and array.dtype.kind in "iub"):
                raise TrainingOpError(f"{where}: input {name!r} is {want.name}, found {array.dtype.name} data")
            array = array.astype(want)
        if array.ndim == 0:
            raise TrainingOpError(f"{where}: input {name!r} needs samples on a first axis, found a scalar")
        per_sample = feed.shape[1:] if feed.shape else None
        if per_sample and all(isinstance(d, int) for d in per_sample) and array.shape[1:] != tuple(per_sample):
            size = int(np.prod(per_sample))
            if int(np.prod(array.shape[1:])) != size:
                raise TrainingOpError(f"{where}: input {name!r} takes samples of shape {list(per_sample)}, found "
                                      f"{list(array.shape[1:])}")
            array = array.reshape((len(array), *per_sample))
        out[name] = np.ascontiguousarray(array)
    counts = {len(a) for a in out.values()}
    if len(counts) > 1:
        raise TrainingOpError(f"{where}: the inputs hold different numbers of samples: "
                              + ", ".join(f"{k} {len(v)}" for k, v in out.items()))
    if counts == {0}:
        raise TrainingOpError(f"{where}: no samples")
    return out
