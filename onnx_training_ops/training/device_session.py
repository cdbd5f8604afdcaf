"""A session's programs and loop when its state lives on a device (``TrainingSession(device=...)``).

The graphs are the ones :func:`~onnx_training_ops.export.export_step` writes, made in memory:
each TrainingInfoProto's main graph + algorithm (:func:`~.program.combined_graph`, the state as
inputs), :func:`~onnx_training_ops.prepare`-d with ``portable=True, flat=True`` (Gradient
expanded, each optimizer lowered to a few standard elementwise ops over its tensors laid end to
end), so every node has a kernel on the device's execution provider and nothing runs in Python
between the batch going up and the loss coming down. Each runs as a
:class:`~.device_program.DeviceProgram` over the store's :class:`~.device_state.DeviceValues`:

* ``step``: one program per TrainingInfoProto (more with ``outputs=``);
* ``evaluate``: the eval-mode loss and outputs (:func:`~.stages.evaluation_model`);
* ``run``: the main graph;
* ``backward``/``optimizer_step``: the stages of :mod:`.stages`, their accumulators device
  tensors beside the state, zeroed after each optimizer step.

The learning rates, the schedule and the feed checks are the host session's
(:mod:`.rates`, :mod:`.session_programs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..errors import TrainingOpError
from ..runtime.pipeline import prepare_model
from ..storage.large_model import LargeModel
from ..storage.tensors import tensor_value
from ..walk import drop_named
from .device_accumulation import DeviceAccumulation
from .device_program import DeviceProgram
from .device_store import DeviceStateStore
from .feeds import Feed, FeedSpec, checked_learning_rate, feed_array, feed_list, feed_spec
from .inference import inference_model
from .options import fresh_options
from .program import combined_graph, learning_rate_inputs
from .rates import LearningRates
from .session_loop import LoopSteps
from .session_programs import FeedChecks, RuntimeConfig
from .stages import GRAD_SCALE, session_evaluation, step_model
from .static_shapes import static_graph


class DeviceGraph:
    """A :class:`~.device_program.DeviceProgram` and what it takes from the host."""

    def __init__(self, program: DeviceProgram, required: list[FeedSpec], optional: list[FeedSpec],
                 rate_defaults: Mapping[str, np.ndarray | None], input_defaults: Mapping[str, np.ndarray]) -> None:
        self.program, self.required, self.optional = program, required, optional
        self.specs = {s.name: s for s in (*required, *optional)}
        self.rate_defaults = dict(rate_defaults)
        self.input_defaults = dict(input_defaults)

    def host_feeds(self, feeds: Mapping[str, Any], rates: float | Mapping[str, float] | None,
                   where: str) -> dict[str, np.ndarray]:
        """Every input's value for this run: the batch (checked against the graph's inputs), an
        optional input's default when it is not fed, the learning rates."""
        arrays = {name: feed_array(self.specs[name], value, where) for name, value in feeds.items()
                  if name in self.specs and name not in self.rate_defaults}
        for name, default in self.input_defaults.items():
            arrays.setdefault(name, default)
        for name, default in self.rate_defaults.items():
            spec = self.specs[name]
            if isinstance(rates, Mapping):
                value = rates.get(name)
            else:
                value = rates
            if value is None and name in feeds:
                value = checked_learning_rate(np.asarray(feeds[name]).reshape(-1)[0], f"{where}: feed {name!r}")
            if value is None:
                if default is None:
                    raise TrainingOpError(f"{where}: learning rate {name!r} has no default: pass lr=")
                arrays[name] = default
                continue
            arrays[name] = np.full(spec.shape or (), value, spec.dtype)
        return arrays


class DevicePrograms:
    """The step, evaluation, inference and accumulation graphs of one model over a device store."""

    def __init__(self, store: DeviceStateStore, meta: Mapping[str, str], config: RuntimeConfig, large: bool,
                 threads: int) -> None:
        self.store, self.meta, self.config, self.large, self.threads = store, meta, config, large, threads
        self.model: LargeModel = store.model
        self.checks = FeedChecks(self.model.model_proto, meta)
        self.steps = self._open_steps(self.model)
        self.required = {s.name: s for g in self.steps for s in g.required}
        self.required_names = frozenset(self.required)
        self.optional = {s.name for g in self.steps for s in g.optional}
        self._with_outputs: dict[tuple[str, ...], list[DeviceGraph]] = {}
        self.evaluations: dict[tuple[str, ...], DeviceGraph] = {}
        self.inference: dict[tuple[str, ...], DeviceGraph] = {}

    # ------------------------------------------------------------------ opening graphs

    def options(self):
        return fresh_options(self.config.sess_options, self.config.session_config, self.large, self.threads,
                             force_threads=self.config.threads is not None)

    def open_graph(self, model: LargeModel, combined: onnx.ModelProto, feedback: Mapping[str, str], where: str,
                   loss: str | None = None, on_nonfinite: str = "ignore", static: bool = False) -> DeviceGraph:
        """A device program for ``combined`` (state as inputs), with its host feeds' specs.
        ``static``: the step, whose data inputs get ``input_shapes`` and whose buffers may sit at
        fixed addresses (CUDA graphs)."""
        graph = combined.graph
        state = self.store.values
        initial = {t.name: t for t in graph.initializer}
        types = {vi.name: vi for vi in graph.input}
        named = tuple(filter(None, [self.meta.get("learning_rate")]))
        _, rate_defaults = learning_rate_inputs(graph, {n: None for n in state}, types, initial, named)
        returned = [o.name for o in graph.output if o.name not in set(feedback.values())]
        input_defaults = {vi.name: np.ascontiguousarray(tensor_value(initial[vi.name], model.large_initializers))
                          for vi in graph.input
                          if vi.name in initial and vi.name not in state and vi.name not in rate_defaults}
        portable = prepare_model(model.with_proto(combined), portable=True, flat=True)
        # every input with a stored default (the learning rates among them) a plain input, fed
        # every run with the default when not given: onnxruntime's IOBinding cannot bind such an
        # input ("Failed to find NodeArg"), and a binding kept from run to run must never hold a
        # value an earlier run fed
        drop_named(portable.model_proto.graph.initializer, set(rate_defaults) | set(input_defaults))
        shapes = self.config.input_shapes
        if static and shapes is not None:
            data = [vi.name for vi in portable.model_proto.graph.input if vi.name not in state]
            portable = portable.with_proto(static_graph(portable.model_proto, data, shapes, "input_shapes"))
        required, optional = [], []
        folded = {vi.name: vi for vi in portable.model_proto.graph.input}
        for vi in graph.input:
            if vi.name in state:
                continue
            spec = feed_spec(folded.get(vi.name, vi))
            (optional if vi.name in initial or vi.name in rate_defaults else required).append(spec)
        fixed = static and self.config.cuda_graph is not False
        program = DeviceProgram(portable, state, feedback, returned, self.options(), self.config.providers,
                                loss=loss, on_nonfinite=on_nonfinite, in_place=None, where=where, fixed=fixed)
        if static and self.config.cuda_graph and not program.graph_capture:
            reason = program.not_fixed or f"the state is on {state.device!r}, not a CUDA device"
            raise TrainingOpError(f"cuda_graph=True but this step cannot be captured: {reason}")
        return DeviceGraph(program, required, optional, rate_defaults, input_defaults)

    def _loss(self, returned: Sequence[str]) -> str | None:
        return next((n for n in self.meta.get("loss", "").split(",") if n and n in returned), None)

    def _open_steps(self, model: LargeModel, static: bool = True) -> list[DeviceGraph]:
        proto = model.model_proto
        graphs = []
        for i, info in enumerate(proto.training_info):
            combined = combined_graph(proto, i, self.store.protos, self.meta)
            feedback = {e.key: e.value for e in info.update_binding}
            returned = [o.name for o in combined.graph.output if o.name not in set(feedback.values())]
            graphs.append(self.open_graph(model, combined, feedback, "step", self._loss(returned),
                                          self.config.on_nonfinite, static=static))
        return graphs

    def for_step(self, outputs: tuple[str, ...]) -> list[DeviceGraph]:
        """The step graphs, returning ``outputs`` too."""
        if not outputs:
            return self.steps
        if outputs not in self._with_outputs:
            derived = self.model.with_proto(step_model(self.model.model_proto, outputs))
            self._with_outputs[outputs] = self._open_steps(derived, static=False)
        return self._with_outputs[outputs]

    def for_evaluation(self, outputs: tuple[str, ...]) -> DeviceGraph:
        """The eval-mode loss (if any) and ``outputs``, nothing written."""
        if outputs not in self.evaluations:
            derived = session_evaluation(self.model.model_proto, self.meta, outputs)
            combined = combined_graph(derived, 0, self.store.protos, self.meta, prune_inputs=True)
            self.evaluations[outputs] = self.open_graph(self.model, combined, {}, "evaluate")
        return self.evaluations[outputs]

    def eval_feeds(self, outputs: tuple[str, ...]) -> list[Feed]:
        graph = self.for_evaluation(outputs)
        return feed_list(graph.required, graph.optional)

    def feeds(self) -> list[Feed]:
        return feed_list([s for g in self.steps for s in g.required], [s for g in self.steps for s in g.optional])

    def check_feeds(self, feeds: Mapping[str, Any], required: set[str], optional: set[str],
                    where: str = "step") -> None:
        self.checks.check(feeds, required, optional, where)

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """The main graph with the current state (``TrainingSession.run``)."""
        names = tuple(output_names) if output_names is not None else tuple(
            o.name for o in self.model.model_proto.graph.output)
        if not isinstance(feeds, Mapping):
            raise TrainingOpError(f"run: feeds must be a mapping of input name to array, found {type(feeds).__name__}")
        if names not in self.inference:
            main = inference_model(self.model, self.store.values, with_state_values=False)
            proto = main.model_proto
            if not proto.graph.output:
                raise TrainingOpError("run: the main graph has no outputs (a from_graph session has no "
                                      "inference graph)")
            graph = proto.graph
            declared = {vi.name for vi in graph.input}
            kept = []
            for tensor in graph.initializer:
                if tensor.name in self.store.values:
                    if tensor.name not in declared:
                        graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                                         list(tensor.dims)))
                else:
                    kept.append(tensor)
            del graph.initializer[:]
            graph.initializer.extend(kept)
            known = {o.name for o in graph.output} | {o for n in graph.node for o in n.output}
            unknown = [n for n in names if n not in known]
            if unknown:
                raise TrainingOpError(f"run: unknown output(s) {unknown}")
            del graph.output[:]
            graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
            self.inference[names] = self.open_graph(main, proto, {}, "run")
        graph = self.inference[names]
        for name in feeds:
            if name in self.store.values:
                raise TrainingOpError(f"run: {name!r} is a state variable, not a feed")
        self.checks.check(feeds, {s.name for s in graph.required}, {s.name for s in graph.optional}, "run")
        result, _ = graph.program.run(graph.host_feeds(feeds, None, "run"))
        return [result[n] for n in names]

    def sessions(self) -> list[Any]:
        graphs = [*self.steps, *self.evaluations.values(), *self.inference.values()]
        graphs += [g for gs in self._with_outputs.values() for g in gs]
        return [g.program.session for g in graphs]

    def graph_capture(self) -> bool:
        """Whether a step replays a CUDA graph."""
        return any(g.program.graph_capture for g in self.steps)

    def fast_path_nodes(self) -> list[str]:
        return []  # every optimizer runs in onnxruntime, lowered to standard ops


class DeviceLoop(LoopSteps):
    """Steps, evaluation, accumulation and learning rates over a device store (``TrainingLoop``'s twin)."""

    def __init__(self, programs: DevicePrograms) -> None:
        self.programs, self.store, self.meta = programs, programs.store, programs.meta
        self.on_nonfinite = programs.config.on_nonfinite
        defaults = {}
        for graph in programs.steps:
            defaults.update(graph.rate_defaults)
        self.rates = LearningRates.from_defaults(defaults, self.meta)
        self.accumulation = DeviceAccumulation(programs)
        self.skipped_steps = 0

    def run_step(self, program: Any, feeds: Mapping[str, Any], rates: Any,
                 then: Callable[[bool], None]) -> dict[str, np.ndarray]:
        return program.program.run(program.host_feeds(feeds, rates, "step"), then)[0]

    def evaluate(self, feeds: Mapping[str, Any], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        self.store.check_filled("evaluate")
        watch, extra = self.evaluation_outputs(outputs)
        graph = self.programs.for_evaluation(tuple(outputs) + extra)
        self.programs.check_feeds(feeds, {s.name for s in graph.required}, {s.name for s in graph.optional},
                                  "evaluate")
        result, _ = graph.program.run(graph.host_feeds(feeds, None, "evaluate"))
        return self.evaluated(feeds, result, watch, extra, outputs)

    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        self.store.check_filled("backward")
        backward, _, _ = self.accumulation.stages()
        self.programs.check_feeds(feeds, {s.name for s in backward.required} - {GRAD_SCALE},
                                  {s.name for s in backward.optional}, "backward")
        scale = checked_learning_rate(scale, "backward: scale")
        host = backward.host_feeds(feeds, None, "backward")
        host[GRAD_SCALE] = np.array(scale, backward.specs[GRAD_SCALE].dtype)

        def counted(skipped: bool) -> None:
            self.count_skipped(skipped)
            if not skipped:
                self.accumulation.count += 1

        result, _ = backward.program.run(host, counted)
        return result

    def optimizer_step(self, lr: Any = None) -> dict[str, np.ndarray]:
        self.check_accumulated()
        _, apply, _ = self.accumulation.stages()

        def applied(_skipped: bool) -> None:
            self.accumulation.zero()
            self.rates.advance()

        result, _ = apply.program.run(apply.host_feeds({}, self.rates.for_step(lr), "optimizer_step"), applied)
        return result

    def buffer_names(self) -> list[str]:
        backward, _, _ = self.accumulation.stages()
        return [k for k in backward.program.feedback if k in self.store.arrays]

    def sessions(self) -> list[Any]:
        if not self.accumulation.built:
            return []
        backward, apply, _ = self.accumulation.stages()
        return [backward.program.session, apply.program.session]


__all__ = ["DeviceGraph", "DeviceLoop", "DevicePrograms"]
