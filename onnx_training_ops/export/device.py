"""Train an export on any execution provider: the export opened as the engine's training model.

:func:`open_export` reads an export directory (:func:`~onnx_training_ops.export.export_step`:
standard ONNX ops, the state as inputs and its new values as outputs) back into a training
model — the step as its algorithm, the eval model as its main graph, the state as
initializers, the manifest's learning rates, input defaults, schedule and label range as the
model's own — and opens a :class:`~onnx_training_ops.TrainingSession` on it whose update runs
in the graph (:mod:`onnx_training_ops.training.engine`): the state resident on the device, written
in place when the guarded step allows it, else into a second set; per step only the batch and
the learning rates go up and the returned values come down. So an export trains with the same
state store, programs, rates, feed checks and checkpoints as any session.

:class:`DeviceTrainer` is the older front end of the same thing (the Python twin of the
JavaScript trainer, ``js/``): a thin alias over :func:`open_export` keeping its names
(``learning_rates()``, ``schedule_step``, ``save_state``) and messages.

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
from onnx import helper, numpy_helper

from ..builder.metadata import LabelRange, TrainingMetadata
from ..errors import TrainingOpError
from ..passes._graph import unique_name
from ..schedules import to_json
from ..storage import safetensors
from ..storage.checkpoint import atomic_write
from ..training.engine import checked_config
from ..training.graphs.static_shapes import checked_input_shapes
from ..training.graphs.step import NONFINITE_POLICIES
from ..training.inputs.feeds import checked_learning_rate
from ..training.options.precision import check_precision
from ..training.options.providers import device_for, device_inputs, placement, provider_name, require_available
from ..training.session.session import TrainingSession
from ..walk import all_graphs
from . import manifest as manifest_
from .importing import manifest_schedule, read_state

EVAL_PREFIX = "eval/"  # the eval model's values whose names the step uses too


def export_training_model(directory: str | os.PathLike, verify: bool = True
                          ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The training model an export directory describes, and its manifest.

    The step model is its algorithm (the state inputs its initializers, each learning rate and
    input default an initializer of its input: an optional input), the eval model its main
    graph (values the step names too renamed ``eval/...``; the metadata's ``eval_loss`` names
    its loss), ``update_binding`` the manifest's feedback; the schedule at the state's position,
    the label range and the precision are the model's metadata.

    Raises:
        TrainingOpError: not an export directory, a damaged file (``verify``), or a manifest
            that does not fit the step model.
    """
    directory = os.fspath(directory)
    state, manifest = read_state(directory, verify)
    if manifest is None:
        raise TrainingOpError(f"{directory!r}: DeviceTrainer takes an export directory (manifest.json)")
    files = manifest["files"]
    step = onnx.load_model_from_string(manifest_.file_bytes(directory, manifest, "step", verify))
    manifest_.check_feedback(step, manifest, os.path.join(directory, files["step"]["path"]))
    feedback: dict[str, str] = dict(manifest["feedback"])  # state input -> step output
    missing = [n for n in feedback if n not in {i.name for i in step.graph.input}]
    if missing:
        raise TrainingOpError(f"{directory!r}: manifest feedback names {missing}, which the step model "
                              "does not take as inputs")
    evaluation = onnx.load_model_from_string(manifest_.file_bytes(directory, manifest, "eval", verify)) \
        if "eval" in files else None

    algorithm = step.graph
    algorithm.name = "algorithm"
    constants = {t.name: t for t in algorithm.initializer}
    main = helper.make_graph([], "main", [], [], [numpy_helper.from_array(state[n], n) for n in feedback])
    loss = manifest.get("loss") or ""
    eval_loss = _eval_as_main(evaluation.graph, main, algorithm, constants, loss) if evaluation is not None else None
    for name in feedback:  # the state: initializers of the main graph, not inputs of the step
        _drop(algorithm.input, name)
    defaults = {e["name"]: np.full(e["shape"], e["base"], e["dtype"]) for e in manifest["learning_rates"]}
    defaults.update({n: np.array(e["values"], e["dtype"]).reshape(e["shape"])
                     for n, e in (manifest.get("defaults") or {}).items()})
    step_inputs = {vi.name for vi in algorithm.input}
    algorithm.initializer.extend(numpy_helper.from_array(v, n) for n, v in defaults.items() if n in step_inputs)
    opsets = {o.domain: o.version for o in (*(evaluation.opset_import if evaluation else ()), *step.opset_import)}
    model = helper.make_model(main, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = max(step.ir_version, evaluation.ir_version if evaluation else 0)
    info = model.training_info.add()
    info.algorithm.CopyFrom(algorithm)
    for name, output in feedback.items():
        info.update_binding.add(key=name, value=output)
    schedule = None
    if manifest.get("schedule"):
        schedule = to_json(*manifest_schedule(manifest, state, repr(os.path.join(directory, manifest_.MANIFEST))))
    labelled = bool(manifest.get("labels")) and manifest.get("classes") is not None
    TrainingMetadata(
        loss=(loss,) if loss else (),
        trainable=tuple(e["name"] for e in manifest["state"] if e.get("role") == "parameter"),
        eval_loss=eval_loss or None,
        learning_rate=tuple(e["name"] for e in manifest["learning_rates"]),
        lr_schedule=schedule,
        labels=manifest["labels"] if labelled else None,
        label_range=LabelRange(manifest["classes"], manifest.get("ignore_index")) if labelled else None,
        precision=manifest.get("precision") or None,
        loss_scaling=(manifest.get("loss_scaling") or None) if manifest.get("precision") else None,
    ).write(model)
    return model, manifest


def _eval_as_main(graph: onnx.GraphProto, main: onnx.GraphProto, step: onnx.GraphProto,
                  constants: Mapping[str, onnx.TensorProto], loss: str) -> str:
    """Put the eval graph into ``main`` (in place): its nodes, data inputs and outputs, its
    constants once (the step's too: one tensor for both), every value it computes that the step
    also names renamed apart. Returns its loss's name."""
    state = {t.name for t in main.initializer}
    taken = {n for g in all_graphs(step) for node in g.node for n in (*node.input, *node.output)}
    taken |= {vi.name for vi in (*step.input, *step.output)} | set(constants)
    renamed: dict[str, str] = {}
    for sub in all_graphs(graph):  # one scope once merged: a body's values too
        for node in sub.node:
            for out in node.output:
                if out and out in taken:
                    renamed[out] = unique_name(taken, EVAL_PREFIX + out)
    for sub in all_graphs(graph):
        for node in sub.node:
            node.input[:] = [renamed.get(n, n) for n in node.input]
            node.output[:] = [renamed.get(n, n) for n in node.output]
    for tensor in graph.initializer:
        shared = constants.get(tensor.name)
        if shared is not None and shared.SerializeToString() != tensor.SerializeToString():
            raise TrainingOpError(f"the eval model's constant {tensor.name!r} differs from the step model's")
        if tensor.name not in state:
            main.initializer.append(tensor)
    _drop_named(step.initializer, {t.name for t in graph.initializer})
    main.node.extend(graph.node)
    main.input.extend(vi for vi in graph.input if vi.name not in state)
    for vi in graph.output:
        out = main.output.add()
        out.CopyFrom(vi)
        out.name = renamed.get(vi.name, vi.name)
    main.value_info.extend(graph.value_info)
    for vi in main.value_info:
        vi.name = renamed.get(vi.name, vi.name)
    return renamed.get(loss, loss)


def _drop(field: Any, name: str) -> None:
    _drop_named(field, {name})


def _drop_named(field: Any, names: set[str]) -> None:
    kept = [entry for entry in field if entry.name not in names]
    del field[:]
    field.extend(kept)


def open_export(directory: str | os.PathLike, providers: Sequence[str | tuple[str, dict]] | None = None, *,
                device: str | None = None, on_nonfinite: str = "raise", sess_options: ort.SessionOptions | None = None,
                verify: bool = True, in_place: bool | None = None,
                input_shapes: Mapping[str, Sequence[int]] | None = None, cuda_graph: bool | None = None,
                threads: int | None = None) -> TrainingSession:
    """A :class:`~onnx_training_ops.TrainingSession` training an export directory, its update in
    the graph (the export's own step) and its state on ``device``.

    Args:
        directory: what :func:`~onnx_training_ops.export.export_step` wrote.
        providers: onnxruntime execution providers (default: the CPU's, or ``device``'s). A
            provider missing from the installed onnxruntime is an error, never a silent CPU run.
        device: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"``: where the state lives (default:
            the device of the first device provider).
        on_nonfinite: what a NaN or infinite loss does (``"raise"``, ``"skip"``, ``"ignore"``).
        sess_options: onnxruntime options, copied for each onnxruntime session.
        verify: check the files against the manifest's SHA-256 digests (False skips it).
        in_place: the step writes its new state over the old (guarded): None when safe, True
            (an error when unsafe), False (two sets).
        input_shapes: static shapes of the step's data inputs (the shape arithmetic folded at
            load; every batch must then have these shapes).
        cuda_graph: as :class:`~onnx_training_ops.TrainingSession`'s.
        threads: intra-op threads of every onnxruntime session.

    Returns:
        The session (its learning rates, schedule and label checks the export's).

    Raises:
        TrainingOpError: not a valid export, a provider that is not available, or an unsafe
            ``in_place=True``.
    """
    if on_nonfinite not in NONFINITE_POLICIES:
        raise TrainingOpError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, found {on_nonfinite!r}")
    where = placement(providers, device)
    found = (where.device, where.device_id) if where.device is not None else device_for(where.providers)
    config = checked_config(where.providers, None, on_nonfinite, sess_options, None, threads, found[0], found[1],
                            device_inputs(input_shapes, found[0]), cuda_graph, in_place)
    model, _ = export_training_model(directory, verify)
    return TrainingSession._opened(model, config)


class DeviceTrainer:
    """Train an export directory on ``providers``, the state resident on their device: a thin
    alias over :func:`open_export` (the session it opened is :attr:`session`).

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
            shape arithmetic is folded at load (:func:`~onnx_training_ops.training.graphs.static_shapes.static_step`),
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
        providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        require_available(providers)
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise TrainingOpError(f"{self.directory!r}: DeviceTrainer takes an export directory (manifest.json)")
        self.manifest = manifest_.read(self.directory)
        check_precision(TrainingMetadata(precision=self.manifest.get("precision") or "fp32"),
                        [provider_name(p) for p in providers], "DeviceTrainer")
        self.device, found_id = device_for(providers)
        self.device_id = int(device_id) if device_id else found_id
        self.input_shapes = checked_input_shapes(input_shapes, "DeviceTrainer") if input_shapes is not None else {}
        self.session = open_export(self.directory, providers,
                                   device="cpu" if self.device == "cpu" else f"{self.device}:{self.device_id}",
                                   on_nonfinite=on_nonfinite, sess_options=sess_options, verify=verify,
                                   in_place=in_place, input_shapes=input_shapes)
        self.on_nonfinite = on_nonfinite
        self._inputs = {e["name"]: e for e in self.manifest["inputs"]}
        self._eval_inputs = {e["name"]: e for e in self.manifest.get("eval_inputs", [])}
        self._defaults = {n: e for n, e in (self.manifest.get("defaults") or {}).items()}
        self._rates = [e["name"] for e in self.manifest["learning_rates"]]
        self._counter = self.manifest.get("counter")
        self._offset = int(self.manifest["schedule"]["step_offset"]) if self.manifest.get("schedule") else 0

    @property
    def in_place(self) -> bool:
        """Whether the step writes its new state over the old (one copy of the state on the device)."""
        return bool(self.session._programs.in_place())

    @property
    def providers(self) -> list[str]:
        """The providers onnxruntime runs the step on."""
        return self.session._programs.steps[0].session.get_providers()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss (``on_nonfinite="skip"``)."""
        return self.session.skipped_steps

    @property
    def state_names(self) -> list[str]:
        """The state variables, in the step model's order."""
        return self.session.state_names

    def state_dict(self) -> dict[str, np.ndarray]:
        """The state, copied to the host (names as in the export)."""
        return self.session.state_dict()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the whole state (every variable, same dtype and shape); nothing changes on error."""
        given, names = set(state), set(self.state_names)
        if given != names:
            raise TrainingOpError(f"load_state_dict: expected the state variables {sorted(names)}, "
                                  f"missing {sorted(names - given)}, unknown {sorted(given - names)}")
        described = self.session._store.described()
        for name in self.state_names:
            array, want = np.asarray(state[name]), described[name]
            if array.dtype != want.dtype or array.shape != tuple(want.shape):
                raise TrainingOpError(f"load_state_dict: {name!r} must be {want.dtype} {list(want.shape)}, "
                                      f"found {array.dtype} {list(array.shape)}")
        with self.session._lock:  # the state and the schedule's position: one change
            self.session.load_state_dict(state)
            if self.session.lr_schedule is not None:
                self.session.set_lr_schedule(self.session.lr_schedule, self.schedule_step)

    def save_state(self, path: str | os.PathLike) -> None:
        """Write the state as ``.safetensors`` (atomically): resume here, in a TrainingSession
        (:func:`~onnx_training_ops.export.load_state`) or in the JavaScript trainer."""
        atomic_write(os.fspath(path), safetensors.encode(self.state_dict()))

    # ------------------------------------------------------------------ steps

    @property
    def schedule_step(self) -> int:
        """Optimizer steps taken under the schedule: the update count plus the manifest's offset."""
        if self._counter not in self.state_names:
            return self.session.lr_schedule_step
        (count,) = self.session._store.memory.download_many([self._counter]).values()
        return int(np.asarray(count).reshape(-1)[0]) + self._offset

    def learning_rates(self) -> dict[str, float]:
        """The rate of each learning-rate input for the next step: the schedule's, else the base."""
        return self.session.learning_rates

    def _rate_values(self, lr: float | Mapping[str, float] | None) -> dict[str, float] | None:
        if lr is None:
            return None
        rates = dict(lr) if isinstance(lr, Mapping) else {n: lr for n in self._rates}
        unknown = set(rates) - set(self._rates)
        if unknown:
            raise TrainingOpError(f"step: unknown learning-rate input(s) {sorted(unknown)}; "
                                  f"the export has {sorted(self._rates)}")
        bases = self.session.learning_rates
        return {name: checked_learning_rate(rates.get(name, bases[name]), f"step: learning rate {name!r}")
                for name in self._rates}

    def _check_feeds(self, feeds: Mapping[str, Any], specs: Mapping[str, dict], what: str) -> dict[str, np.ndarray]:
        """The manifest's view of the feeds (its messages), before the session's own checks."""
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
            arrays[name] = array
        return arrays

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
        return self.session.step(arrays, lr=self._rate_values(lr))

    def evaluate(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The eval model's outputs (loss, logits...) with the current state; nothing changes."""
        if "eval" not in self.manifest["files"]:
            raise TrainingOpError(f"evaluate: the export {self.directory!r} has no eval model")
        arrays = self._check_feeds(feeds, self._eval_inputs, "evaluate")
        loss = self.manifest.get("loss")
        outputs = [o.name for o in self.session._store.model.model_proto.graph.output]
        named = {o: o[len(EVAL_PREFIX):] if o.startswith(EVAL_PREFIX) else o for o in outputs}
        eval_loss = self.session.metadata.get("eval_loss")
        result = self.session.evaluate(arrays, outputs=[o for o in outputs if o != eval_loss])
        return {(loss if name == loss else named.get(name, name)): value for name, value in result.items()}


__all__ = ["DeviceTrainer", "export_training_model", "open_export"]
