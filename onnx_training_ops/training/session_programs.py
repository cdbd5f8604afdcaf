"""A session's programs part: the onnxruntime sessions that train and evaluate its model.

:class:`SessionPrograms` opens one program per TrainingInfoProto over the state store's arrays
(:mod:`.program`, :mod:`.binding`), the step programs returning extra outputs and the
evaluation programs on first use, and the inference session :meth:`SessionPrograms.run` uses;
it knows what each takes (feed names, specs, the checks before onnxruntime runs).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import TrainingOpError
from ..storage.large_model import LargeModel
from ..storage.tensors import proto_of
from .binding import open_program
from .checks import batch_checker, label_mismatch
from .feeds import Feed, FeedSpec, check_feed_names, feed_array, feed_list, feed_spec
from .flat_parameters import lay_out_flat
from .inference import inference_session
from .input_checks import input_checker
from .options import fresh_options
from .program import Program, build_program, program_feeds
from .stages import session_evaluation, step_model
from .state_store import StateStore


@dataclass(frozen=True)
class RuntimeConfig:
    """How a session runs its programs: what the caller chose when opening it."""

    providers: Sequence[Any]
    fast: bool
    on_nonfinite: str
    sess_options: ort.SessionOptions | None = None
    session_config: Mapping[str, str] = field(default_factory=dict)
    threads: int | None = None  # as given (None: the package's default for the model's size)
    device: str | None = None  # the state's device (device-resident session), None: host arrays
    device_id: int = 0
    input_shapes: Mapping[str, Sequence[int]] | None = None  # the step's data inputs fixed (device)
    cuda_graph: bool | None = None  # None: CUDA graphs when safe


class FeedChecks:
    """The checks a session's feeds pass before onnxruntime runs: names, the batch (labels
    against the loss's output) and the inputs (lengths, token ids against the vocabulary)."""

    def __init__(self, proto: onnx.ModelProto, meta: Mapping[str, str]) -> None:
        initializers = {t.name for t in proto.graph.initializer}
        data_inputs = [vi for vi in proto.graph.input if vi.name not in initializers]
        self._batch = {where: batch_checker(meta, data_inputs, where) for where in ("step", "backward", "evaluate")}
        self._inputs = {where: input_checker(proto.graph, initializers, where)
                        for where in ("step", "backward", "evaluate", "run")}

    def check(self, feeds: Mapping[str, Any], required: set[str], optional: set[str], where: str) -> None:
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


class SessionPrograms:
    """The step, evaluation and inference programs of one model over one state store."""

    def __init__(self, store: StateStore, meta: Mapping[str, str], config: RuntimeConfig, large: bool,
                 threads: int) -> None:
        """Opens the step programs (laying the state out flat first).

        Args:
            store: the state the programs bind.
            meta: the builder's metadata.
            config: the caller's runtime choices.
            large: the model is large (memory options, constants bound as inputs).
            threads: the intra-op thread count every onnxruntime session gets.
        """
        self.store, self.meta, self.config, self.large, self.threads = store, meta, config, large, threads
        self.model: LargeModel = store.model
        self.steps: list[Program] = self.open(self.model)
        self.required: dict[str, FeedSpec] = {}
        for program in self.steps:
            for spec in program.feeds:
                self.required.setdefault(spec.name, spec)
        self.required_names: frozenset[str] = frozenset(self.required)
        self.optional: set[str] = {spec.name for p in self.steps for spec, _ in p.optional_feeds}
        self.optional.update(name for p in self.steps for name in p.rate_inputs)
        self.checks = FeedChecks(self.model.model_proto, meta)
        self._with_outputs: dict[tuple[str, ...], list[Program]] = {}
        self.evaluations: dict[tuple[str, ...], Program] = {}
        self.inference: tuple[Any, list[str]] | None = None
        self._run_specs: dict[str, FeedSpec] | None = None

    def options(self) -> ort.SessionOptions:
        """A fresh SessionOptions per onnxruntime session (:mod:`.options`)."""
        return fresh_options(self.config.sess_options, self.config.session_config, self.large, self.threads,
                             force_threads=self.config.threads is not None)

    def open(self, model: LargeModel, rehome: bool = True) -> list[Program]:
        """One program per TrainingInfoProto, bound to the state. fast=False: the native
        optimizers write the state in place (guarded against a non-finite loss unless it is
        ignored; a guarded step is redone by a copying twin). ``rehome``: the first programs
        lay the state out (each cut node's flat, then the trainables as one buffer if still
        apart: ``get_flat_parameters`` without a copy); later ones find it laid out."""
        state, fast = self.store.arrays, self.config.fast
        built = [build_program(model, i, state, self.store.protos, self.meta, fast)
                 for i in range(len(model.model_proto.training_info))]
        for _, analysis in built:  # before anything binds a state array: lay the cut state out flat
            analysis.cut.lay_out(state, rehome, self.store.zero_filled)
        if rehome:
            lay_out_flat(state, [n for n in self.store.trainable_names() if n in state])
        programs = [open_program(graph, analysis, state, self.options(), self.config.providers, in_place=not fast,
                                 guard=self.config.on_nonfinite != "ignore", constants_as_inputs=self.large)
                    for graph, analysis in built]
        for program in programs:
            if program.guarded:
                program.fallback = functools.partial(self._copying_program, program.index, model)
        # the fused loops compile (or load from numba's cache) when the first step plans the cut
        # updates, announced: only those this model's tensors run, not every specialization
        return programs

    def _copying_program(self, index: int, model: LargeModel) -> Program:
        """Program ``index`` of ``model`` without in-place writes: it redoes a step the guard stopped."""
        graph, analysis = build_program(model, index, self.store.arrays, self.store.protos, self.meta, False)
        return open_program(graph, analysis, self.store.arrays, self.options(), self.config.providers)

    def for_step(self, outputs: tuple[str, ...]) -> list[Program]:
        """The step programs, returning ``outputs`` too (opened on first use, bound to the state)."""
        if not outputs:
            return self.steps
        if outputs not in self._with_outputs:
            derived = self.model.with_proto(step_model(self.model.model_proto, outputs))
            self._with_outputs[outputs] = self.open(derived, rehome=False)
        return self._with_outputs[outputs]

    def for_evaluation(self, outputs: tuple[str, ...]) -> Program:
        """The evaluation program computing the eval-mode loss (if any) and ``outputs``."""
        if outputs not in self.evaluations:
            derived = session_evaluation(self.model.model_proto, self.meta, outputs)
            graph, analysis = build_program(self.model.with_proto(derived), 0, self.store.arrays,
                                            self.store.protos, self.meta, False, prune_inputs=True, where="evaluate")
            self.evaluations[outputs] = open_program(graph, analysis, self.store.arrays, self.options(),
                                                     self.config.providers)
        return self.evaluations[outputs]

    def feeds(self) -> list[Feed]:
        """What a step takes: name, dtype, shape, optional."""
        required, optional = [], []
        for program in self.steps:
            r, o = program_feeds(program)
            required += r
            optional += o
        return feed_list(required, optional)

    def check_feeds(self, feeds: Mapping[str, Any], required: set[str], optional: set[str],
                    where: str = "step") -> None:
        """Names, then the batch's and the inputs' checks, before onnxruntime runs."""
        self.checks.check(feeds, required, optional, where)

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """The main graph with the current state (``TrainingSession.run``)."""
        if self.inference is None:
            self.inference = inference_session(self.model, self.store.arrays, self.options(),
                                               self.config.providers)
        session, state_inputs = self.inference
        if self._run_specs is None:
            self._run_specs = {vi.name: feed_spec(vi) for vi in proto_of(self.model).graph.input}
        if not isinstance(feeds, Mapping):
            raise TrainingOpError(f"run: feeds must be a mapping of input name to array, found {type(feeds).__name__}")
        full = {name: feed_array(self._run_specs[name], value, "run") if name in self._run_specs else value
                for name, value in feeds.items()}  # a wrong dtype or shape: one line, as in step
        self.checks.check_inputs(full, "run")
        for name in state_inputs:
            if name in full:
                raise TrainingOpError(f"run: {name!r} is a state variable, not a feed")
            full[name] = self.store.arrays[name]
        try:
            return session.run(output_names, full)
        except TrainingOpError:
            raise
        except Exception as error:
            raise TrainingOpError(f"run: {error}") from error

    def explain_failure(self, feeds: Mapping[str, Any], where: str, error: TrainingOpError) -> None:
        """Re-raise ``error``, or, when the labels do not fit what the loss's output is for this
        batch (run the main graph to know), a one-line feed error instead of onnxruntime's."""
        output = json.loads(self.meta.get("label_shape") or "{}").get("output")
        if output and "onnxruntime failed" in str(error):
            try:
                data = {k: v for k, v in feeds.items() if k in {vi.name for vi in proto_of(self.model).graph.input}}
                message = label_mismatch(self.meta, feeds, self.run([output], data)[0].shape, where)
            except Exception:  # noqa: BLE001 - the forward pass fails too: onnxruntime's error stands
                message = ""
            if message:
                raise TrainingOpError(message) from None
        raise error

    def eval_feeds(self, outputs: tuple[str, ...]) -> list[Feed]:
        """What the evaluation program for ``outputs`` takes."""
        return feed_list(*program_feeds(self.for_evaluation(outputs)))

    def graph_capture(self) -> bool:
        """Whether a step replays a CUDA graph (never: the host-array session runs on the CPU)."""
        return False

    def fast_path_nodes(self) -> list[Any]:
        """The optimizer nodes the fused kernels apply in place."""
        return [n for p in self.steps for n in p.cut_nodes]

    def sessions(self) -> list[Any]:
        """The onnxruntime sessions opened so far (steps, evaluations, inference)."""
        found = [p.session for p in self.steps] + [p.session for p in self.evaluations.values()]
        return found + ([self.inference[0]] if self.inference is not None else [])
