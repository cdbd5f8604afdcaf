"""And back: a state trained outside Python (a ``.safetensors`` file, or an export directory)
into a :class:`~onnx_training_ops.TrainingSession`, which continues from it bit-exact.

The tensors are the state variables under their own names (the step model's input names),
so loading is :meth:`TrainingSession.load_state_dict` with every variable required. The
schedule's position moves with the update count T: both advance once per applied step,
so ``position - T`` is the same before and after steps taken elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import numpy as np
import onnx

from ..builder.metadata import LabelRange, TrainingMetadata
from ..errors import TrainingOpError
from ..schedules import SCHEDULES
from ..storage import safetensors
from ..storage.external_data import map_external
from ..storage.large_model import LargeModel
from . import manifest as manifest_
from .writer import FILES


def read_state(path: str | os.PathLike, verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """(state, manifest or None) of an export directory or a ``.safetensors`` file.

    Args:
        path: an export directory (its manifest validated, the state file's path kept inside
            it) or a ``.safetensors`` file.
        verify: check the SHA-256 digests (the manifest's of the state file, the file's own of
            its data) where they are recorded; False skips them, for speed.

    Returns:
        (name -> array, the manifest or None for a bare file).

    Raises:
        TrainingOpError: a bad manifest, a damaged or mismatched state file.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        manifest = manifest_.read(path)
        where = repr(manifest_.file_path(path, manifest, "state"))
        state, _ = safetensors.decode(manifest_.file_bytes(path, manifest, "state", verify), where, verify)
        declared = {e["name"]: e for e in manifest["state"]}
        if set(declared) != set(state):
            raise TrainingOpError(f"{path!r}: the state file holds {sorted(state)}, the manifest declares "
                                  f"{sorted(declared)}")
        for name, entry in declared.items():
            if state[name].dtype.name != entry["dtype"] or list(state[name].shape) != entry["shape"]:
                raise TrainingOpError(f"{where}: tensor {name!r} is {state[name].dtype.name} "
                                      f"{list(state[name].shape)}, the manifest's field 'state' declares "
                                      f"{entry['dtype']} {entry['shape']}")
        return state, manifest
    state, _ = safetensors.read(path, verify)
    return state, None


def _counter_value(state: dict[str, np.ndarray], name: str | None) -> int | None:
    return None if name is None or name not in state else int(state[name].reshape(-1)[0])


def _only_counter(state: dict[str, np.ndarray]) -> str | None:
    found = [n for n, v in state.items() if v.dtype == np.int64 and v.size == 1]
    return found[0] if len(found) == 1 else None


def manifest_schedule(manifest: dict[str, Any], state: dict[str, np.ndarray], where: str):
    """(schedule, position) of a manifest's ``schedule`` at the state's update count, checked.

    Raises:
        TrainingOpError: unknown arguments, bad values, or a negative position.
    """
    schedule = manifest["schedule"]  # types checked by manifest_.validate
    cls = SCHEDULES[schedule["type"]]
    args = dict(schedule["args"])
    if isinstance(args.get("milestones"), list):
        args["milestones"] = tuple(args["milestones"])
    try:
        built = cls(**args)
    except TrainingOpError as error:
        raise TrainingOpError(f"{where}: field 'schedule.args': {error}") from None
    except (TypeError, ValueError) as error:
        raise TrainingOpError(f"{where}: field 'schedule.args' {schedule['args']!r} does not fit "
                              f"{schedule['type']}: {error}") from None
    counter = _counter_value(state, schedule["counter"])
    if state[schedule["counter"]].dtype.kind not in "iu" or state[schedule["counter"]].size != 1:
        raise TrainingOpError(f"{where}: field 'schedule.counter' names {schedule['counter']!r}, which is not an "
                              "integer scalar")
    position = counter + schedule["step_offset"]
    if position < 0:
        raise TrainingOpError(f"{where}: field 'schedule.step_offset' is {schedule['step_offset']}, so the "
                              f"schedule's position (update count {counter} + step_offset) is {position}; it "
                              "must be >= 0")
    return built, position


def load_state(session, path: str | os.PathLike, verify: bool = True) -> None:
    """Load the state of an export directory or ``.safetensors`` file into ``session``.

    Every state variable is required, with the same names, dtypes and shapes. From a directory
    whose manifest has a schedule, the session takes that schedule at the position the state
    has reached; from a bare file, the session's own schedule moves as far as the update
    count did. Everything is checked before anything changes: on an error the session keeps
    its state and schedule.

    Args:
        session: a :class:`~onnx_training_ops.TrainingSession`.
        path: an export directory or a ``.safetensors`` file.
        verify: check the recorded SHA-256 digests (False skips them, for speed).

    Raises:
        TrainingOpError: a bad manifest or file, a state that does not fit the session, a bad schedule.
    """
    state, manifest = read_state(path, verify)
    where = repr(os.path.join(os.fspath(path), manifest_.MANIFEST)) if manifest is not None else repr(os.fspath(path))
    if manifest is not None and manifest.get("schedule"):
        schedule, position = manifest_schedule(manifest, state, where)
        with session._lock:  # one change: no step between the state and the schedule
            old = session.lr_schedule, session.lr_schedule_step
            session.set_lr_schedule(schedule, position)  # validated against the session first
            try:
                session.load_state_dict(state)
            except BaseException:
                session.set_lr_schedule(*old)
                raise
        return
    counter = manifest.get("counter") if manifest else _only_counter(state)
    with session._lock:
        before = session.state_views([counter])[0].reshape(-1)[0] if counter in session.state_names else None
        session.load_state_dict(state)
        if session.lr_schedule is not None and before is not None:
            offset = session.lr_schedule_step - int(before)
            session.set_lr_schedule(session.lr_schedule, max(0, _counter_value(state, counter) + offset))


def pack(state: dict[str, np.ndarray], packs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The named state laid out as the packed step's inputs (``manifest["packs"]``)."""
    return {p["input"]: np.concatenate([state[m["name"]].reshape(-1) for m in p["members"]]) for p in packs}


def session_from_export(directory: str | os.PathLike, packed: bool = False, verify: bool = True, **kwargs: Any):
    """A :class:`TrainingSession` running the export's step model itself.

    The session is ``from_graph`` (the feedback map, the exported state); the learning rates
    and data are feeds of each step. Class labels are checked against the manifest's
    ``classes`` / ``ignore_index`` before each step, as a built model's session does.

    Args:
        directory: the export directory.
        packed: run the packed step (``export_step(..., packed=True)``), its state variables the packs.
        verify: check the files' SHA-256 digests recorded in the manifest (False skips them).
        **kwargs: for the session (``fast=False``, ``sess_options``...).

    Returns:
        The session.

    Raises:
        TrainingOpError: a bad manifest, a damaged file, a feedback map that does not fit the step.
    """
    from ..training.session.from_graph import graph_to_training_model
    from ..training.session.session import TrainingSession

    directory = os.fspath(directory)
    state, manifest = read_state(directory, verify)
    if manifest is None:
        raise TrainingOpError(f"{directory!r}: a state file, not an export directory: a session runs an export's "
                              "step model (the directory export_step wrote, with manifest.json)")
    kind = "step_packed" if packed else "step"
    if packed and not manifest.get("packs"):
        raise TrainingOpError(f"{directory!r}: no packed step (export with packed=True)")
    if kind not in manifest["files"]:
        raise TrainingOpError(f"{os.path.join(directory, manifest_.MANIFEST)!r}: field 'files' has no entry {kind!r}")
    step = manifest_.file_bytes(directory, manifest, kind, verify)
    feedback = {out: name for name, out in manifest["feedback"].items()}
    initial = {name: state[name] for name in manifest["feedback"]}
    if packed:
        for p in manifest["packs"]:
            for m in p["members"]:
                del feedback[manifest["feedback"][m["name"]]], initial[m["name"]]
            feedback[p["output"]] = p["input"]
        initial.update(pack(state, manifest["packs"]))
    constants = manifest_.verified_constants(directory, manifest, kind, verify)
    try:
        model = graph_to_training_model(step, feedback, initial)
    except TrainingOpError as error:
        raise TrainingOpError(f"{os.path.join(directory, manifest_.MANIFEST)!r}: field 'feedback' does not fit "
                              f"{manifest['files'][kind]['path']!r}: {error}") from None
    # outputs that exist but are fed to the wrong state (a swap of equal shapes): the model's own record
    manifest_.check_feedback(onnx.load_model_from_string(step), manifest,
                             os.path.join(directory, manifest["files"][kind]["path"]), packed)
    if manifest.get("labels") and manifest.get("classes") is not None:
        replace(TrainingMetadata.from_model(model), labels=manifest["labels"],
                label_range=LabelRange(manifest["classes"], manifest.get("ignore_index"))).write(model)
    if constants is not None:  # a model past 2 GB: its weights memory-mapped from constants.data, never in a message
        return TrainingSession(map_external(LargeModel(model), directory), **kwargs)
    return TrainingSession(model, **kwargs)


__all__ = ["FILES", "load_state", "read_state", "session_from_export"]
