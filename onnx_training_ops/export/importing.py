"""And back: a state trained outside Python (a ``.safetensors`` file, or an export directory)
into a :class:`~onnx_training_ops.TrainingSession`, which continues from it bit-exact.

The tensors are the state variables under their own names (the step model's input names),
so loading is :meth:`TrainingSession.load_state_dict` with every variable required. The
schedule's position moves with the update count T: both advance once per applied step,
so ``position - T`` is the same before and after steps taken elsewhere.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import TrainingOpError
from ..training.schedules import SCHEDULES
from . import manifest as manifest_, safetensors
from .writer import FILES


def read_state(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """(state, manifest or None) of an export directory or a ``.safetensors`` file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        manifest = manifest_.read(path)
        state, _ = safetensors.read(os.path.join(path, manifest["files"]["state"]["path"]))
        declared = {e["name"]: e for e in manifest["state"]}
        if set(declared) != set(state):
            raise TrainingOpError(f"{path!r}: the state file holds {sorted(state)}, the manifest declares "
                                  f"{sorted(declared)}")
        return state, manifest
    state, _ = safetensors.read(path)
    return state, None


def _counter_value(state: dict[str, np.ndarray], name: str | None) -> int | None:
    return None if name is None or name not in state else int(state[name].reshape(-1)[0])


def _only_counter(state: dict[str, np.ndarray]) -> str | None:
    found = [n for n, v in state.items() if v.dtype == np.int64 and v.size == 1]
    return found[0] if len(found) == 1 else None


def load_state(session, path: str | os.PathLike) -> None:
    """Load the state of an export directory or ``.safetensors`` file into ``session`` (every
    state variable, same names, dtypes and shapes). From a directory whose manifest has a
    schedule, the session takes that schedule at the position the state has reached; from a
    bare file, the session's own schedule moves as far as the update count did."""
    state, manifest = read_state(path)
    if manifest is not None and manifest.get("schedule"):
        schedule = manifest["schedule"]
        counter = schedule["counter"]
        cls = SCHEDULES.get(schedule["type"])
        if cls is None:
            raise TrainingOpError(f"{os.fspath(path)!r}: unknown schedule {schedule['type']!r}")
        args = dict(schedule["args"])
        if "milestones" in args:
            args["milestones"] = tuple(args["milestones"])
        position = _counter_value(state, counter) + int(schedule["step_offset"])
        session.load_state_dict(state)
        session.set_lr_schedule(cls(**args), position)
        return
    counter = manifest.get("counter") if manifest else _only_counter(state)
    before = session.state_views([counter])[0].reshape(-1)[0] if counter in session.state_names else None
    session.load_state_dict(state)
    if session.lr_schedule is not None and before is not None:
        offset = session.lr_schedule_step - int(before)
        session.set_lr_schedule(session.lr_schedule, max(0, _counter_value(state, counter) + offset))


def pack(state: dict[str, np.ndarray], packs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The named state laid out as the packed step's inputs (``manifest["packs"]``)."""
    return {p["input"]: np.concatenate([state[m["name"]].reshape(-1) for m in p["members"]]) for p in packs}


def session_from_export(directory: str | os.PathLike, packed: bool = False, **kwargs: Any):
    """A :class:`TrainingSession` running the export's step model itself (``from_graph``: the
    feedback map, the exported state); the learning rates and data are feeds of each step.
    ``packed``: the packed step (``export_step(..., packed=True)``), its state variables the
    packs. Keyword arguments go to the session (``fast=False``, ``sess_options``...)."""
    from ..training.session import TrainingSession

    state, manifest = read_state(directory)
    step = os.path.join(os.fspath(directory), manifest["files"]["step_packed" if packed else "step"]["path"])
    feedback = {out: name for name, out in manifest["feedback"].items()}
    initial = {name: state[name] for name in manifest["feedback"]}
    if packed:
        if not manifest.get("packs"):
            raise TrainingOpError(f"{os.fspath(directory)!r}: no packed step (export with packed=True)")
        for p in manifest["packs"]:
            for m in p["members"]:
                del feedback[manifest["feedback"][m["name"]]], initial[m["name"]]
            feedback[p["output"]] = p["input"]
        initial.update(pack(state, manifest["packs"]))
    return TrainingSession.from_graph(step, feedback, initial_state=initial, **kwargs)


__all__ = ["FILES", "load_state", "read_state", "session_from_export"]
