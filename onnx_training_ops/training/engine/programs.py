"""The engine's programs part: the onnxruntime programs that train, evaluate and run its model.

:class:`SessionPrograms` opens, through the session's update strategy (:mod:`.protocols`), one
step program per TrainingInfoProto (more, on first use, for steps returning extra outputs) and
the evaluation programs, and serves ``run`` (the main graph with the current state); it knows
what each takes (feed names, specs, the checks before onnxruntime runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...runtime.kernel_table import CUDA
from ...storage.large_model import LargeModel
from ...storage.tensors import proto_of
from ..graphs.inference import inference_model, inference_session
from ..graphs.stages import session_evaluation, step_model
from ..inputs.checks import batch_checker, label_mismatch
from ..inputs.feeds import Feed, FeedSpec, check_feed_names, feed_array, feed_list, feed_spec
from ..inputs.input_checks import input_checker
from ..options.options import fresh_options
from .config import RuntimeConfig
from .fused import FusedUpdate
from .graph import GraphProgram, GraphUpdate
from .memory import HostMemory
from .protocols import EngineProgram, UpdateStrategy
from .store import StateStore


class FeedChecks:
    """The checks a session's feeds pass before onnxruntime runs: names, the batch (labels
    against the loss's output) and the inputs (lengths, token ids against the vocabulary)."""

    def __init__(self, proto: onnx.ModelProto, meta: TrainingMetadata) -> None:
        initializers = {t.name for t in proto.graph.initializer}
        data_inputs = [vi for vi in proto.graph.input if vi.name not in initializers]
        self._batch = {where: batch_checker(meta, data_inputs, where) for where in ("step", "backward", "evaluate")}
        self._inputs = {where: input_checker(proto.graph, initializers, where)
                        for where in ("step", "backward", "evaluate", "run")}

    def check(self, feeds: Mapping[str, Any], required: Set[str], optional: Set[str], where: str) -> None:
        """Names, then the batch's and the inputs' checks."""
        if type(feeds) is not dict and not isinstance(feeds, Mapping):
            raise TrainingOpError(f"{where}: feeds must be a mapping of input name to array, found "
                                  f"{type(feeds).__name__}; inputs: {sorted(required)}")
        check_feed_names(feeds, required, optional, where)
        batch = self._batch.get(where)
        if batch is not None:
            batch(feeds)
        self.check_inputs(feeds, where)

    def check_inputs(self, feeds: Mapping[str, Any], where: str) -> None:
        """The inputs' checks alone (``run``: after its own dtype and shape checks)."""
        check = self._inputs.get(where)
        if check is not None:
            check(feeds)


def update_strategy(store: StateStore, meta: TrainingMetadata, config: RuntimeConfig, options: Any,
                    large: bool) -> UpdateStrategy:
    """The strategy ``config`` selects (:mod:`.config`), over ``store``'s memory."""
    if config.update == "graph":
        return GraphUpdate(store.memory, store.protos, meta, config.on_nonfinite, options, config.providers,
                           config.input_shapes, config.cuda_graph, config.in_place, store.trainable_names(),
                           config.graphs_for)
    if not isinstance(store.memory, HostMemory):
        raise TrainingOpError("the fused kernels update host arrays: a device memory needs device=...")
    return FusedUpdate(store.memory, store.protos, meta, store.trainable_names(), store.zero_filled, config.fast,
                       config.on_nonfinite, options, config.providers, large)


class SessionPrograms:
    """The step, evaluation and inference programs of one model over one state store.

    Args:
        store: the state the programs bind.
        meta: the builder's metadata.
        config: the caller's runtime choices (they select the update strategy).
        large: the model is large (memory options, constants bound as inputs).
        threads: the intra-op thread count every onnxruntime session gets.
    """

    def __init__(self, store: StateStore, meta: TrainingMetadata, config: RuntimeConfig, large: bool,
                 threads: int) -> None:
        self.store, self.meta, self.config, self.large, self.threads = store, meta, config, large, threads
        self.model: LargeModel = store.model
        self.update: UpdateStrategy = update_strategy(store, meta, config, self.options, large)
        self.steps: list[EngineProgram] = list(self.update.open_steps(self.model, True))
        self.required: dict[str, FeedSpec] = {}
        for program in self.steps:
            for spec in program.required:
                self.required.setdefault(spec.name, spec)
        self.required_names: frozenset[str] = frozenset(self.required)
        self.optional: set[str] = {spec.name for p in self.steps for spec in p.optional}
        self.checks = FeedChecks(self.model.model_proto, meta)
        self._with_outputs: dict[tuple[str, ...], list[EngineProgram]] = {}
        self.evaluations: dict[tuple[str, ...], EngineProgram] = {}
        self.inference: Any = None  # host memory: (session, state inputs); a device: {outputs: program}
        self._run_specs: dict[str, FeedSpec] | None = None

    def options(self) -> ort.SessionOptions:
        """A fresh SessionOptions per onnxruntime session (:mod:`..options.options`)."""
        return fresh_options(self.config.sess_options, self.config.session_config, self.large, self.threads,
                             force_threads=self.config.threads is not None)

    def for_step(self, outputs: tuple[str, ...]) -> list[EngineProgram]:
        """The step programs, returning ``outputs`` too (opened on first use, bound to the state)."""
        if not outputs:
            return self.steps
        if outputs not in self._with_outputs:
            derived = self.model.with_proto(step_model(self.model.model_proto, outputs))
            self._with_outputs[outputs] = list(self.update.open_steps(derived, False))
        return self._with_outputs[outputs]

    def for_evaluation(self, outputs: tuple[str, ...]) -> EngineProgram:
        """The evaluation program computing the eval-mode loss (if any) and ``outputs``."""
        if outputs not in self.evaluations:
            derived = session_evaluation(self.model.model_proto, self.meta, outputs)
            self.evaluations[outputs] = self.update.open_evaluation(self.model.with_proto(derived))
        return self.evaluations[outputs]

    def feeds(self) -> list[Feed]:
        """What a step takes: name, dtype, shape, optional."""
        return feed_list([s for p in self.steps for s in p.required], [s for p in self.steps for s in p.optional])

    def eval_feeds(self, outputs: tuple[str, ...]) -> list[Feed]:
        """What the evaluation program for ``outputs`` takes."""
        program = self.for_evaluation(outputs)
        return feed_list(program.required, program.optional)

    def check_feeds(self, feeds: Mapping[str, Any], required: Set[str], optional: Set[str],
                    where: str = "step") -> None:
        """Names, then the batch's and the inputs' checks, before onnxruntime runs."""
        self.checks.check(feeds, required, optional, where)

    # ------------------------------------------------------------------ run: the main graph

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """The main graph with the current state (``TrainingSession.run``)."""
        if not isinstance(feeds, Mapping):
            raise TrainingOpError(f"run: feeds must be a mapping of input name to array, found {type(feeds).__name__}")
        for name in feeds:
            if name in self.store.arrays:
                raise TrainingOpError(f"run: {name!r} is a state variable, not a feed")
        if self.store.live:
            return self._run_on_host(output_names, feeds)
        return self._run_on_device(output_names, feeds)

    def _run_on_host(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """An onnxruntime session of the main graph fed the state arrays (read in place)."""
        if self.inference is None:
            self.inference = inference_session(self.model, self.store.arrays, self.options(),
                                               self.config.providers)
        session, state_inputs = self.inference
        if self._run_specs is None:
            self._run_specs = {vi.name: feed_spec(vi) for vi in proto_of(self.model).graph.input}
        full = {name: feed_array(self._run_specs[name], value, "run") if name in self._run_specs else value
                for name, value in feeds.items()}  # a wrong dtype or shape: one line, as in step
        self.checks.check_inputs(full, "run")
        for name in state_inputs:
            full[name] = self.store.arrays[name]
        try:
            return session.run(output_names, full)
        except TrainingOpError:
            raise
        except Exception as error:
            raise TrainingOpError(f"run: {error}") from error

    def _run_on_device(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """A graph program of the main graph, per set of outputs, over the device state."""
        names = tuple(output_names) if output_names is not None else tuple(
            o.name for o in self.model.model_proto.graph.output)
        if self.inference is None:
            self.inference = {}
        if names not in self.inference:
            self.inference[names] = self._inference_program(names)
        program = self.inference[names]
        self.checks.check(feeds, {s.name for s in program.required}, {s.name for s in program.optional}, "run")
        result = program.run(feeds)
        return [result[n] for n in names]

    def _inference_program(self, names: tuple[str, ...]) -> GraphProgram:
        memory = self.store.memory
        main = inference_model(self.model, self.store.arrays, with_state_values=False)
        graph = main.model_proto.graph
        if not graph.output:
            raise TrainingOpError("run: the main graph has no outputs (a from_graph session has no "
                                  "inference graph)")
        declared = {vi.name for vi in graph.input}
        kept = []
        for tensor in graph.initializer:
            if tensor.name in memory:
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
        update = self.update
        assert isinstance(update, GraphUpdate)  # a device memory runs the in-graph strategy
        return update.open(main, main.model_proto, {}, "run")

    def explain_failure(self, feeds: Mapping[str, Any], where: str, error: TrainingOpError) -> None:
        """Re-raise ``error``, or, when the labels do not fit what the loss's output is for this
        batch (run the main graph to know), a one-line feed error instead of onnxruntime's."""
        output = (self.meta.label_shape or {}).get("output")
        if output and "onnxruntime failed" in str(error):
            try:
                data = {k: v for k, v in feeds.items() if k in {vi.name for vi in proto_of(self.model).graph.input}}
                message = label_mismatch(self.meta, feeds, self.run([output], data)[0].shape, where)
            except Exception:  # noqa: BLE001 - the forward pass fails too: onnxruntime's error stands
                message = ""
            if message:
                raise TrainingOpError(message) from None
        raise error

    # ------------------------------------------------------------------ introspection

    def graph_capture(self) -> bool:
        """Whether a step replays a CUDA graph."""
        return any(p.graph_capture for p in self.steps)

    def capture_note(self) -> str | None:
        """Why the steps of a session on a CUDA device replay no CUDA graph, in a few words (None:
        they do, or the session is not on one): nodes without a kernel on the device first."""
        steps = [p for p in self.steps if isinstance(p, GraphProgram)]
        if not steps or any(p.graph_capture for p in steps) or all(p.provider != CUDA for p in steps):
            return None
        for p in steps:
            if p.off_device:
                return f"{len(p.off_device)} node(s) without a {p.provider} kernel run on the CPU"
        device = self.store.memory.device
        return next((r for p in steps for r in (p.not_captured, p.not_fixed) if r),
                    None if device == "cuda" else f"the state is on {device!r}")

    def in_place(self) -> bool | None:
        """Whether the in-graph steps write the state over itself (None: the fused strategies)."""
        found = [p.in_place for p in self.steps if isinstance(p, GraphProgram) and p.feedback]
        return all(found) if found else None

    def fast_path_nodes(self) -> list[Any]:
        """The optimizer nodes the fused kernels apply in place."""
        return [n for p in self.steps for n in p.cut_nodes]

    def sessions(self) -> list[Any]:
        """The onnxruntime sessions opened so far (steps, evaluations, inference)."""
        programs = [*self.steps, *self.evaluations.values(), *(p for ps in self._with_outputs.values() for p in ps)]
        found = [p.session for p in programs]
        if isinstance(self.inference, tuple):
            found.append(self.inference[0])
        elif isinstance(self.inference, dict):
            found += [p.session for p in self.inference.values()]
        return found


__all__ = ["FeedChecks", "SessionPrograms", "update_strategy"]
