"""Train an export on any execution provider, its state resident on the device between steps.

:class:`DeviceTrainer` runs the exported step model (:func:`~onnx_training_ops.export.export_step`:
standard ONNX ops, the state as inputs and its new values as outputs) in onnxruntime with
IOBinding, over the same device-resident state as ``TrainingSession(device=...)``
(:mod:`~onnx_training_ops.training.device_program`): the state lives on the device as
OrtValues, written in place when the guarded step allows it, else into a second set that
becomes the state only when the step is kept. So per step only the batch and the learning
rates go up and the returned values (loss, grad norm) come down; no host array is bound as a
device input (onnxruntime copies such an input once, at bind time, which would freeze the
parameters at their first value), and a NaN loss leaves the state as it was without a copy.
This is the Python twin of the JavaScript trainer (``js/``).

On a CPU-only machine the same code runs with ``device="cpu"`` (what the test suite checks);
on a GPU, ``providers=["CUDAExecutionProvider", "CPUExecutionProvider"]`` (onnxruntime-gpu).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import TrainingOpError
from ..storage import safetensors
from ..storage.checkpoint import atomic_write
from ..storage.model_files import as_model
from ..training.checks import check_classes
from ..training.device_program import DeviceProgram
from ..training.device_state import DeviceValues
from ..training.feeds import checked_learning_rate
from ..training.precision import check_precision
from ..training.providers import device_for, provider_name, require_available
from ..training.schedules import checked_rate
from ..training.static_shapes import checked_input_shapes, static_step
from ..training.step import NONFINITE_POLICIES
from . import manifest as manifest_
from .importing import manifest_schedule, read_state


class DeviceTrainer:
    """Train an export directory on ``providers``, the state resident on their device.

    Args:
        directory: what :func:`~onnx_training_ops.export.export_step` wrote.
        providers: onnxruntime execution providers (default: the CPU's). A provider missing from
            the installed onnxruntime is an error, never a silent CPU run.
        device_id: the device's index (``"cuda"`` devices).
        on_nonfinite: ``"raise"`` (:class:`NonFiniteLossError`), ``"skip"`` or ``"ignore"``: what a
            NaN or infinite loss does; the first two keep the state as it was.
        sess_options: onnxruntime SessionOptions for the step and eval sessions.
        verify: check the files against the manifest's SHA-256 digests (False skips it, for speed).
        in_place: write the new state over the old one (one copy of the state on the device
            instead of two). The step is guarded so that a non-finite loss keeps the old state
            (:mod:`~onnx_training_ops.passes.guard_feedback`); a state variable some node could read
            after its new value is written makes it unsafe. ``None`` (default): in place when safe;
            ``True``: an error when unsafe; ``False``: two sets.
        input_shapes: static shapes of the data inputs (``{"input_ids": [8, 256]}``): the step's
            shape arithmetic is folded at load (:func:`~onnx_training_ops.training.static_shapes.static_step`),
            so no shape computation runs per step (on a GPU, no host round trip for it); every
            batch must then have these shapes.

    Raises:
        TrainingOpError: the directory is not a valid export, a provider is not available, or
            ``in_place=True`` is unsafe for this step model.
    """

    def __init__(self, directory: str | os.PathLike, providers: Sequence[str | tuple[str, dict]] | None = None,
                 *, device_id: int = 0, on_nonfinite: str = "raise",
                 sess_options: ort.SessionOptions | None = None, verify: bool = True,
                 in_place: bool | None = None,
                 input_shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise TrainingOpError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, found {on_nonfinite!r}")
        providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        require_available(providers)
        self.directory = os.fspath(directory)
        state, manifest = read_state(self.directory, verify)
        if manifest is None:
            raise TrainingOpError(f"{self.directory!r}: DeviceTrainer takes an export directory (manifest.json)")
        self.manifest = manifest
        check_precision({"precision": manifest.get("precision") or "fp32"}, [provider_name(p) for p in providers],
                        "DeviceTrainer")
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self.device, found_id = device_for(providers)
        self.device_id = int(device_id) if device_id else found_id
        files = manifest["files"]
        # the bytes checked against the manifest's sha256, read from inside the directory
        step_model = onnx.load_model_from_string(manifest_.file_bytes(self.directory, manifest, "step", verify))
        manifest_.check_feedback(step_model, manifest, os.path.join(self.directory, files["step"]["path"]))
        feedback: dict[str, str] = dict(manifest["feedback"])  # state input -> step output
        self.input_shapes = checked_input_shapes(input_shapes, "DeviceTrainer") if input_shapes is not None else {}
        if input_shapes is not None:
            data = [e["name"] for e in manifest["inputs"]]
            step_model = static_step(step_model, data, self.input_shapes, "DeviceTrainer")
        missing = [n for n in feedback if n not in {i.name for i in step_model.graph.input}]
        if missing:
            raise TrainingOpError(f"{self.directory!r}: manifest feedback names {missing}, which the step model "
                                  "does not take as inputs")
        self._state = DeviceValues({name: state[name] for name in feedback}, self.device, self.device_id)
        self._returned = list(manifest["returned"])
        self._loss = manifest.get("loss")
        self._step = DeviceProgram(as_model(step_model, copy=False), self._state, feedback, self._returned,
                                   sess_options, providers, loss=self._loss, on_nonfinite=on_nonfinite,
                                   in_place=in_place, where="step")
        self._eval = None
        if "eval" in files:
            evaluation = onnx.load_model_from_string(manifest_.file_bytes(self.directory, manifest, "eval", verify))
            self._eval = DeviceProgram(as_model(evaluation, copy=False), self._state, {},
                                       [o.name for o in evaluation.graph.output], sess_options, providers,
                                       where="evaluate")
        self._inputs = {e["name"]: e for e in manifest["inputs"]}
        self._eval_inputs = {e["name"]: e for e in manifest.get("eval_inputs", [])}
        self._defaults = {n: np.array(e["values"], e["dtype"]).reshape(e["shape"])
                          for n, e in (manifest.get("defaults") or {}).items()}
        self._rates = {e["name"]: np.zeros(e["shape"], e["dtype"]) for e in manifest["learning_rates"]}
        self._bases = {e["name"]: float(e["base"]) for e in manifest["learning_rates"]}
        self._schedule = None
        self._schedule_offset = 0
        if manifest.get("schedule"):
            self._schedule, _ = manifest_schedule(manifest, state, repr(os.path.join(self.directory, "manifest.json")))
            self._schedule_offset = int(manifest["schedule"]["step_offset"])
        self._counter = manifest.get("counter")
        self._classes = manifest.get("classes")
        self._ignore_index = manifest.get("ignore_index")
        self._labels = manifest.get("labels")
        self._count = int(np.asarray(state[self._counter]).reshape(-1)[0]) if self._counter in state else 0

    @property
    def in_place(self) -> bool:
        """Whether the step writes its new state over the old (one copy of the state on the device)."""
        return self._step.in_place

    @property
    def providers(self) -> list[str]:
        """The providers onnxruntime runs the step on."""
        return self._step.session.get_providers()

    @property
    def state_names(self) -> list[str]:
        """The state variables, in the step model's order."""
        return list(self._state)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The state, copied to the host (names as in the export)."""
        return {name: self._state.download(name) for name in self._state}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the whole state (every variable, same dtype and shape); nothing changes on error."""
        given, names = set(state), set(self._state)
        if given != names:
            raise TrainingOpError(f"load_state_dict: expected the state variables {sorted(names)}, "
                                  f"missing {sorted(names - given)}, unknown {sorted(given - names)}")
        checked = {}
        for name in self._state:
            array = np.asarray(state[name])
            dtype, shape = self._state.dtype(name), self._state.shape(name)
            if array.dtype != dtype or array.shape != shape:
                raise TrainingOpError(f"load_state_dict: {name!r} must be {dtype} {list(shape)}, "
                                      f"found {array.dtype} {list(array.shape)}")
            checked[name] = array
        for name, array in checked.items():
            self._state.upload(name, array)
        self._count = int(np.asarray(checked[self._counter]).reshape(-1)[0]) if self._counter in checked else 0

    def save_state(self, path: str | os.PathLike) -> None:
        """Write the state as ``.safetensors`` (atomically): resume here, in a TrainingSession
        (:func:`~onnx_training_ops.export.load_state`) or in the JavaScript trainer."""
        atomic_write(os.fspath(path), safetensors.encode(self.state_dict()))

    # ------------------------------------------------------------------ steps

    @property
    def schedule_step(self) -> int:
        """Optimizer steps taken under the schedule: the update count plus the manifest's offset."""
        return self._count + self._schedule_offset

    def learning_rates(self) -> dict[str, float]:
        """The rate of each learning-rate input for the next step: the schedule's, else the base."""
        if self._schedule is None:
            return dict(self._bases)
        k = self.schedule_step
        return {n: checked_rate(self._schedule, base, k, n) for n, base in self._bases.items()}

    def _rate_values(self, lr: float | Mapping[str, float] | None) -> dict[str, float]:
        if lr is None:
            return self.learning_rates()
        rates = dict(lr) if isinstance(lr, Mapping) else {n: lr for n in self._rates}
        unknown = set(rates) - set(self._rates)
        if unknown:
            raise TrainingOpError(f"step: unknown learning-rate input(s) {sorted(unknown)}; "
                                  f"the export has {sorted(self._rates)}")
        for name in self._rates:
            rates[name] = checked_learning_rate(rates.get(name, self._bases[name]), f"step: learning rate {name!r}")
        return rates

    def _check_feeds(self, feeds: Mapping[str, Any], specs: Mapping[str, dict], what: str) -> dict[str, np.ndarray]:
        if not isinstance(feeds, Mapping):
            raise TrainingOpError(f"{what}: feeds must be a mapping of input name to array, "
                                  f"found {type(feeds).__name__}")
        unknown = set(feeds) - set(specs)
        if unknown:
            raise TrainingOpError(f"{what}: unknown input(s) {sorted(unknown)}; the model takes {sorted(specs)}")
        arrays = {}
        for name, spec in specs.items():
            if name not in feeds:
                if name in self._defaults:
                    arrays[name] = self._defaults[name]
                    continue
                raise TrainingOpError(f"{what}: input {name!r} is missing; the model takes {sorted(specs)}")
            array = feeds[name]
            if not isinstance(array, np.ndarray) or array.dtype != np.dtype(spec["dtype"]):
                found = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
                raise TrainingOpError(f"{what}: input {name!r} must be a {spec['dtype']} array, found {found}")
            shape = self.input_shapes.get(name, spec.get("shape")) if what == "step" else spec.get("shape")
            if shape is not None and (array.ndim != len(shape) or any(
                    isinstance(d, int) and d != n for d, n in zip(shape, array.shape))):
                raise TrainingOpError(f"{what}: input {name!r} must have shape {shape}, found {list(array.shape)}")
            arrays[name] = np.require(array, requirements="C")
        self._check_labels(arrays, what)
        return arrays

    def _check_labels(self, arrays: Mapping[str, np.ndarray], what: str) -> None:
        """Labels in [0, classes) or equal to ignore_index, when the manifest records the class count."""
        if self._classes is None or self._labels not in arrays:
            return
        ignore = None if self._ignore_index is None else int(self._ignore_index)
        check_classes(what, self._labels, arrays[self._labels], int(self._classes), ignore)

    def step(self, feeds: Mapping[str, np.ndarray], lr: float | Mapping[str, float] | None = None
             ) -> dict[str, np.ndarray]:
        """One training step on the device.

        Args:
            feeds: the step's data inputs (``manifest["inputs"]``), numpy arrays.
            lr: one rate for every group or ``{input name: rate}`` (default: the schedule's).

        Returns:
            The returned outputs (the loss, ...), on the host.

        Raises:
            NonFiniteLossError: the loss was NaN or infinite (``on_nonfinite="raise"``); the state
                is as it was.
            TrainingOpError: a missing, unknown or malformed input or rate.
        """
        arrays = self._check_feeds(feeds, self._inputs, "step")
        for name, value in self._rate_values(lr).items():
            buf = self._rates[name]
            buf[...] = value
            arrays[name] = buf

        def counted(skipped: bool) -> None:
            if skipped:
                self.skipped_steps += 1
            else:
                self._count += 1

        result, _ = self._step.run(arrays, counted)
        return result

    def evaluate(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The eval model's outputs (loss, logits...) with the current state; nothing changes."""
        if self._eval is None:
            raise TrainingOpError(f"evaluate: the export {self.directory!r} has no eval model")
        result, _ = self._eval.run(self._check_feeds(feeds, self._eval_inputs, "evaluate"))
        return result


__all__ = ["DeviceTrainer"]
