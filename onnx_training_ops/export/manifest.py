"""``manifest.json``: what a client needs to train with an export, in any language.

Version 1 holds (see ``docs/export.md`` for every field):

* ``files``: the step, eval and inference models and the state, each with the ops it uses;
* ``inputs`` / ``eval_inputs``: the data a step / an evaluation takes (name, dtype, shape
  with symbolic dims as strings), ``defaults`` for data inputs that had a stored value;
* ``learning_rates``: one input per parameter group, with its base rate and parameters;
* ``feedback``: state input <- the step output holding its new value;
* ``returned`` / ``eval_outputs``: what a step / an evaluation gives back (loss, ``grad_norm``);
* ``state``: each state variable's name, dtype, shape and role (parameter, optimizer,
  counter, buffer), in the step model's input order;
* ``optimizer`` and ``schedule``: the rate of optimizer step ``k`` is the schedule's, for
  ``k = counter + step_offset`` (both advance once per applied step);
* ``classes`` / ``ignore_index``: the class range labels must lie in (null without class labels).

Each ``files`` entry carries the ``sha256`` of its bytes; every path stays inside the export
directory. :func:`read` validates all of it (:func:`validate`, one schema in one place) and
:func:`file_bytes` reads a named file, its digest checked. Manifests of older exports lack
``sha256``, ``classes`` and ``ignore_index``: those checks are then skipped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import onnx

from ..builder.metadata import TrainingMetadata
from ..errors import TrainingOpError
from ..training.arrays import np_dtype

FORMAT = "onnx-training-ops/export"
VERSION = 1
MANIFEST = "manifest.json"


def value_entry(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    """``{"name", "dtype", "shape"}`` of a graph input or output; symbolic dims as strings
    (their name, or ``"?"``), a shape of null when unknown."""
    tt = vi.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return {"name": vi.name, "dtype": np_dtype(tt.elem_type).name, "shape": shape}


def tensor_entry(name: str, array: np.ndarray, **extra: Any) -> dict[str, Any]:
    return {"name": name, "dtype": array.dtype.name, "shape": list(array.shape), **extra}


def state_roles(state: list[str], meta: TrainingMetadata, counter: str | None) -> dict[str, str]:
    """parameter (trained), optimizer (V, H...), counter (T) or buffer (other state: BatchNorm
    running statistics)."""
    trainable = set(meta.trainable)
    optimizer = {v for values in (meta.optimizer_state or {}).values() for v in values}
    roles = {}
    for name in state:
        roles[name] = ("parameter" if name in trainable else "optimizer" if name in optimizer
                       else "counter" if name == counter else "buffer")
    return roles


def learning_rate_entries(rates: Mapping[str, np.ndarray], meta: TrainingMetadata) -> list[dict[str, Any]]:
    """One entry per learning-rate input: name, dtype, base rate, and with parameter groups
    the group's name and parameters (without, the one rate drives every parameter)."""
    groups = {g["learning_rate"]: g for g in meta.param_groups or ()}
    entries = []
    for name, value in rates.items():
        extra = {"group": groups[name]["name"], "params": groups[name]["params"]} if name in groups else {}
        entries.append(tensor_entry(name, value, base=float(value.reshape(-1)[0]), **extra))
    return entries


def default_entries(defaults: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Inputs other than learning rates that had a stored value: kept in the manifest (small
    values only), so a client feeds it when the batch does not."""
    entries = {}
    for name, value in defaults.items():
        if value.size > 64:
            raise TrainingOpError(f"export: input {name!r} has a stored default of {value.size} elements; "
                                  "the exported graphs take plain inputs only and the manifest keeps small "
                                  "defaults (<= 64 elements): make it an initializer (not an input) or feed it")
        entries[name] = tensor_entry(name, value, values=value.reshape(-1).tolist())
    return entries


def write(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, separators=(",", ":")) + "\n").encode()


def read(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of an export directory, validated.

    Args:
        directory: the export directory.

    Returns:
        The manifest (format, version, every field's type, names and paths checked).

    Raises:
        TrainingOpError: unreadable, not JSON, another format or version, a field of the wrong
            type, or a path leaving the directory; the message names ``manifest.json`` and the field.
    """
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except OSError as error:
        raise TrainingOpError(f"{path!r}: cannot read the export's manifest: {error.strerror or error}") from None
    except ValueError as error:
        raise TrainingOpError(f"{path!r}: the manifest is not JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TrainingOpError(f"{path!r}: not an onnx-training-ops export manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise TrainingOpError(f"{path!r}: manifest version {manifest.get('version')!r}; this package reads "
                              f"version {VERSION}")
    validate(manifest, path)
    for kind in manifest["files"]:
        file_path(directory, manifest, kind)
    return manifest


# ------------------------------------------------------------------ validation

def _fail(where: str, field: str, expected: str, value: Any) -> TrainingOpError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return TrainingOpError(f"{where}: field {field!r} must be {expected}, found {shown}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_SHA256 = re.compile(r"[0-9a-f]{64}")
ROLES = ("parameter", "optimizer", "counter", "buffer")

# field -> (test, what it must be)
_Test = tuple[Callable[[Any], bool], str]
_STR: _Test = (lambda v: isinstance(v, str) and v != "", "a non-empty string")
_OPT_STR: _Test = (lambda v: v is None or (isinstance(v, str) and v != ""), "a non-empty string or null")
_NATURAL: _Test = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
_OPT_INT: _Test = (lambda v: v is None or _is_int(v), "an integer or null")
_STRS: _Test = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")
_DTYPE: _Test = (lambda v: isinstance(v, str) and _known_dtype(v), "a numpy dtype name (float32, int64...)")
_SHAPE: _Test = (lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v),
                 "a list of integers >= 0")
_DIMS: _Test = (lambda v: v is None or (isinstance(v, list) and all((_is_int(d) and d >= 0) or isinstance(d, str)
                                                                    for d in v)),
                "null or a list of integers >= 0 and dimension names")


def _known_dtype(name: str) -> bool:
    try:
        return np.dtype(name).name == name
    except TypeError:
        return False


def _check(where: str, field: str, value: Any, test: _Test) -> None:
    if not test[0](value):
        raise _fail(where, field, test[1], value)


def _entries(where: str, field: str, value: Any, fields: Mapping[str, _Test], optional: Mapping[str, _Test] = {},
             by_name: bool = False) -> None:
    """``value``: a list (or with ``by_name`` a dict by name) of objects holding ``fields`` (and maybe ``optional``)."""
    if not isinstance(value, dict if by_name else list):
        raise _fail(where, field, f"a{'n object' if by_name else ' list'} of entries", value)
    items: Iterable[tuple[Any, Any]] = value.items() if isinstance(value, dict) else enumerate(value)
    for key, entry in items:
        at = f"{field}[{key!r}]" if by_name else f"{field}[{key}]"
        if not isinstance(entry, dict):
            raise _fail(where, at, "an object", entry)
        for name, test in fields.items():
            if name not in entry:
                raise TrainingOpError(f"{where}: field {at!r} lacks {name!r}")
            _check(where, f"{at}.{name}", entry[name], test)
        for name, test in optional.items():
            if name in entry:
                _check(where, f"{at}.{name}", entry[name], test)


def validate(manifest: Mapping[str, Any], where: str = MANIFEST) -> None:
    """Check every field of a version-1 manifest (types, names, paths as text).

    Args:
        manifest: the parsed ``manifest.json``.
        where: how messages name the file.

    Raises:
        TrainingOpError: naming ``where`` and the first field that is missing or of the wrong type.
    """
    for field in ("files", "state", "feedback"):
        if field not in manifest:
            raise TrainingOpError(f"{where}: the manifest lacks the required field {field!r}")
    _validate_files(where, manifest["files"])
    _entries(where, "state", manifest["state"], {"name": _STR, "dtype": _DTYPE, "shape": _SHAPE},
             {"role": (lambda v: v in ROLES, f"one of {list(ROLES)}")})
    state = [e["name"] for e in manifest["state"]]
    if len(set(state)) != len(state):
        raise _fail(where, "state", "a list of distinct names", state)
    feedback = manifest["feedback"]
    _validate_feedback(where, feedback, state)
    _validate_values(where, manifest)
    _validate_scalars(where, manifest, state)
    if manifest.get("packs") is not None:
        _validate_packs(where, manifest["packs"], {e["name"]: e for e in manifest["state"]}, feedback)
    if manifest.get("schedule") is not None:
        _validate_schedule(where, manifest["schedule"], state)


def _validate_files(where: str, files: Any) -> None:
    """``files``: an object of file entries (``step`` and ``state`` among them), paths inside the directory."""
    if not isinstance(files, dict):
        raise _fail(where, "files", "an object of file entries", files)
    for kind in ("step", "state"):
        if kind not in files:
            raise TrainingOpError(f"{where}: field 'files' lacks the entry {kind!r}")
    _entries(where, "files", files, {"path": _STR},
             {"operators": _STRS, "external_data": _STR, "constants": _STR,
              "sha256": (lambda v: isinstance(v, str) and bool(_SHA256.fullmatch(v)),
                         "64 lowercase hex digits (a SHA-256)")}, by_name=True)
    for kind, entry in files.items():
        for key in ("path", "external_data", "constants"):
            if key in entry:
                checked_relative(entry[key], where, f"files[{kind!r}].{key}")


def _validate_feedback(where: str, feedback: Any, state: list[str]) -> None:
    """``feedback``: each state input to its own step output."""
    if not isinstance(feedback, dict):
        raise _fail(where, "feedback", "an object mapping state inputs to step outputs", feedback)
    for name, output in feedback.items():
        if name not in state:
            raise TrainingOpError(f"{where}: field 'feedback' names {name!r}, which is not a state variable "
                                  f"(field 'state': {state[:8]}{'...' if len(state) > 8 else ''})")
        _check(where, f"feedback[{name!r}]", output, _STR)
    if len(set(feedback.values())) != len(feedback):
        raise _fail(where, "feedback", "distinct step outputs (one per state input)", feedback)


def _validate_values(where: str, manifest: Mapping[str, Any]) -> None:
    """The value entries: inputs, eval_inputs, defaults, learning_rates."""
    value = {"name": _STR, "dtype": _DTYPE, "shape": _DIMS}
    for field in ("inputs", "eval_inputs"):
        if field in manifest:
            _entries(where, field, manifest[field], value)
    if "defaults" in manifest:
        _entries(where, "defaults", manifest["defaults"], {**value, "values": (
            lambda v: isinstance(v, list) and all(isinstance(x, (int, float)) for x in v),
            "a list of numbers (or booleans)")}, by_name=True)
    if "learning_rates" in manifest:
        _entries(where, "learning_rates", manifest["learning_rates"],
                 {"name": _STR, "dtype": _DTYPE, "base": (lambda v: _is_int(v) or (isinstance(v, float) and
                                                                                    math.isfinite(v)),
                                                          "a finite number")},
                 {"group": _STR, "params": _STRS, "shape": _SHAPE})


def _validate_scalars(where: str, manifest: Mapping[str, Any], state: list[str]) -> None:
    """The single-valued fields: names, counts, the optimizer's record."""
    for field in ("returned", "eval_outputs"):
        if field in manifest:
            _check(where, field, manifest[field], _STRS)
    for field in ("loss", "labels", "counter"):
        if field in manifest:
            _check(where, field, manifest[field], _OPT_STR)
    if manifest.get("counter") is not None and manifest["counter"] not in state:
        raise _fail(where, "counter", "a state variable or null", manifest["counter"])
    for field, test in (("classes", (lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1 or null")),
                        ("ignore_index", _OPT_INT), ("ir_version", _OPT_INT)):
        if field in manifest:
            _check(where, field, manifest[field], test)
    kinds: tuple[tuple[str, type, str], ...] = (("optimizer", dict, "an object or null"),
                                                ("param_groups", list, "a list or null"),
                                                ("opset", dict, "an object or null"))
    for field, kind, expected in kinds:
        if manifest.get(field) is not None and not isinstance(manifest[field], kind):
            raise _fail(where, field, expected, manifest[field])


def _validate_packs(where: str, packs: Any, state: Mapping[str, Mapping[str, Any]],
                    feedback: Mapping[str, str]) -> None:
    """Each pack: its members fed-back state variables of its dtype, laid out back to back."""
    _entries(where, "packs", packs, {"dtype": _DTYPE, "input": _STR, "output": _STR,
                                     "size": _NATURAL,
                                     "members": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list")})
    packed: set[str] = set()
    for i, p in enumerate(packs):
        _entries(where, f"packs[{i}].members", p["members"], {"name": _STR, "offset": _NATURAL, "shape": _SHAPE})
        offset = 0
        for j, m in enumerate(p["members"]):
            at = f"packs[{i}].members[{j}]"
            if m["name"] not in feedback or m["name"] in packed:
                raise TrainingOpError(f"{where}: field {at + '.name'!r} is {m['name']!r}, which is not a fed-back "
                                      "state variable, or is packed twice")
            packed.add(m["name"])
            entry = state[m["name"]]
            if m["shape"] != entry["shape"] or entry["dtype"] != p["dtype"]:
                raise TrainingOpError(f"{where}: field {at!r}: {p['dtype']} {m['shape']}, the state variable "
                                      f"{m['name']!r} is {entry['dtype']} {entry['shape']}")
            if m["offset"] != offset:
                raise _fail(where, f"{at}.offset", f"{offset} (the members lie back to back)", m["offset"])
            offset += math.prod(m["shape"])
        if p["size"] != offset:
            raise _fail(where, f"packs[{i}].size", f"{offset} (the members' total)", p["size"])


def _validate_schedule(where: str, schedule: Any, state: list[str]) -> None:
    from ..schedules import SCHEDULES

    if not isinstance(schedule, dict):
        raise _fail(where, "schedule", "an object or null", schedule)
    for name, test in (("type", (lambda v: isinstance(v, str) and v in SCHEDULES, f"one of {sorted(SCHEDULES)}")),
                       ("args", (lambda v: isinstance(v, dict), "an object")),
                       ("counter", (lambda v: v in state, "the name of a state variable (the update count)")),
                       ("step_offset", (_is_int, "an integer"))):
        if name not in schedule:
            raise TrainingOpError(f"{where}: field 'schedule' lacks {name!r}")
        _check(where, f"schedule.{name}", schedule[name], test)


def checked_relative(path: Any, where: str, field: str) -> str:
    """``path`` if it is a relative path that stays inside its directory (no ``..``, not absolute)."""
    if not isinstance(path, str) or not path:
        raise _fail(where, field, "a non-empty relative path", path)
    parts = re.split(r"[\\/]", path)
    if os.path.isabs(path) or path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path) or ".." in parts \
            or "\0" in path:
        raise TrainingOpError(f"{where}: field {field!r} is {path!r}: paths must be relative and stay inside "
                              "the export directory (no '..', not absolute)")
    return path


def file_path(directory: str | os.PathLike, manifest: Mapping[str, Any], kind: str) -> str:
    """The path of file ``kind`` of the manifest, checked to resolve inside ``directory``
    (a symlink leading out of it is refused).

    Raises:
        TrainingOpError: no such entry, or a path leaving the directory.
    """
    directory = os.fspath(directory)
    where = os.path.join(directory, MANIFEST)
    entry = manifest["files"].get(kind)
    if entry is None:
        raise TrainingOpError(f"{where!r}: field 'files' has no entry {kind!r}")
    for key in ("path", "external_data", "constants"):
        if key in entry:
            relative = checked_relative(entry[key], repr(where), f"files[{kind!r}].{key}")
            root = os.path.realpath(directory)
            real = os.path.realpath(os.path.join(directory, relative))
            if os.path.commonpath([root, real]) != root:
                raise TrainingOpError(f"{where!r}: field 'files[{kind!r}].{key}' is {relative!r}, which resolves "
                                      f"to {real!r}, outside the export directory (a symlink out is refused)")
    return os.path.join(directory, entry["path"])


FEEDBACK_KEY = "onnx_training_ops.feedback"  # a step model's own feedback map, in its metadata_props


def record_feedback(step: onnx.ModelProto, feedback: Mapping[str, str]) -> None:
    """Store ``feedback`` (state input -> the output holding its new value) in the step model
    itself, so a reader can tell a manifest whose feedback was edited (swapped entries of equal
    shape feed state into the wrong variable without any other sign)."""
    for entry in list(step.metadata_props):
        if entry.key == FEEDBACK_KEY:
            step.metadata_props.remove(entry)
    step.metadata_props.add(key=FEEDBACK_KEY, value=json.dumps(dict(feedback), sort_keys=True))


def step_feedback(manifest: Mapping[str, Any], packed: bool = False) -> dict[str, str]:
    """What the (packed) step model feeds back, by the manifest: state input -> step output."""
    feedback = dict(manifest["feedback"])
    if packed:
        for p in manifest.get("packs") or []:
            for m in p["members"]:
                feedback.pop(m["name"], None)
            feedback[p["input"]] = p["output"]
    return feedback


def check_feedback(step: onnx.ModelProto, manifest: Mapping[str, Any], where: str, packed: bool = False) -> None:
    """The manifest's feedback against the one the step model records (:func:`record_feedback`);
    a model without a record (an older export) is not checked.

    Raises:
        TrainingOpError: an entry differs, naming it.
    """
    recorded = next((e.value for e in step.metadata_props if e.key == FEEDBACK_KEY), None)
    if recorded is None:
        return
    try:
        expected = json.loads(recorded)
    except ValueError:
        raise TrainingOpError(f"{where}: its {FEEDBACK_KEY!r} metadata is not JSON") from None
    given = step_feedback(manifest, packed)
    if given != expected:
        wrong = sorted(k for k in set(given) | set(expected) if given.get(k) != expected.get(k))
        name = wrong[0]
        raise TrainingOpError(
            f"{where}: manifest.json field 'feedback' feeds {name!r} from {given.get(name)!r}, but the step "
            f"model feeds it from {expected.get(name)!r} ({len(wrong)} entr{'y' if len(wrong) == 1 else 'ies'} "
            "differ: swapped, dropped or foreign feedback entries)")


def sha256(data: bytes | memoryview) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """Lowercase hex SHA-256 of a file, read in blocks (constants.data may pass 2 GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def verified_constants(directory: str | os.PathLike, manifest: Mapping[str, Any], kind: str,
                       verify: bool = True) -> str | None:
    """The path of the constants file that model ``kind`` reads (``files[kind].constants``), its
    SHA-256 checked against the manifest's ``files.constants`` (streamed); None when it reads none.

    Raises:
        TrainingOpError: no ``files.constants`` entry, a path leaving the directory, or a digest that differs.
    """
    entry = manifest["files"][kind]
    if "constants" not in entry:
        return None
    file_path(directory, manifest, kind)  # its constants path stays inside the directory
    path = file_path(directory, manifest, "constants")
    if os.path.normpath(path) != os.path.normpath(os.path.join(os.fspath(directory), entry["constants"])):
        raise TrainingOpError(f"{os.path.join(os.fspath(directory), MANIFEST)!r}: field 'files[{kind!r}].constants' "
                              f"is {entry['constants']!r}, not the file of 'files.constants' "
                              f"({manifest['files']['constants']['path']!r})")
    expected = manifest["files"]["constants"].get("sha256")
    try:
        digest = file_sha256(path) if verify and expected is not None else None
    except OSError as error:
        raise TrainingOpError(f"cannot read {path!r} (manifest field 'files.constants'): "
                              f"{error.strerror or error}") from None
    if digest is not None and digest != expected:
        raise TrainingOpError(f"{path!r}: its SHA-256 differs from the manifest's (field 'files.constants.sha256'): "
                              "the file is damaged or was replaced (verify=False skips this check)")
    return path


def file_bytes(directory: str | os.PathLike, manifest: Mapping[str, Any], kind: str, verify: bool = True) -> bytes:
    """The bytes of file ``kind`` of an export, checked against the manifest's ``sha256``.

    Args:
        directory: the export directory.
        manifest: its manifest (:func:`read`).
        kind: the ``files`` entry (``"step"``, ``"state"``...).
        verify: check the digest (when the manifest has one); False skips it, for speed.

    Returns:
        The file's bytes.

    Raises:
        TrainingOpError: the file is unreadable, outside the directory, or its digest differs.
    """
    path = file_path(directory, manifest, kind)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise TrainingOpError(f"cannot read {path!r} (manifest field 'files[{kind!r}]'): "
                              f"{error.strerror or error}") from None
    expected = manifest["files"][kind].get("sha256")
    if verify and expected is not None and sha256(data) != expected:
        raise TrainingOpError(f"{path!r}: its SHA-256 differs from the manifest's (field 'files[{kind!r}].sha256'): "
                              "the file is damaged or was replaced (verify=False skips this check)")
    return data
