"""The fused update strategy: host arrays, the optimizer nodes applied around onnxruntime's run.

Each program is :func:`~..graphs.program.build_program`'s analysis opened on the state arrays by
:func:`~..graphs.binding.open_program` and run by :func:`~..graphs.step.run_program`:

* ``fast=True`` (the CPU's default): the optimizer nodes whose outputs feed only
  ``update_binding`` are cut out of the graph (:mod:`..fastpath.fast_path`); onnxruntime writes the
  gradients into flat buffers and the fused numba kernels (and the other in-place updates:
  lazy table rows, RMSProp, :mod:`..fastpath.in_place_updates`) update the state in place after the run,
  one pass over memory;
* ``fast=False``: the optimizer nodes stay in the graph as the native kernels, which write the
  new state into the state arrays during the run (:mod:`..fastpath.in_place`), behind a guard that stops
  a non-finite loss before them (the step is then redone by a copying twin of the program).

Both need the state in host memory (:class:`~.memory.HostMemory`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ...builder.metadata import TrainingMetadata
from ...storage.large_model import LargeModel
from ..graphs.binding import open_program
from ..graphs.program import Program, build_program, program_feeds
from ..graphs.stages import Stages
from ..graphs.step import run_program
from ..inputs.feeds import FeedSpec
from ..state.flat_parameters import lay_out_flat
from .memory import HostMemory


class FusedProgram:
    """A :class:`~..graphs.program.Program` as the engine runs it (attributes not named here are the
    program's own: ``analysis``, ``session``, ``in_place``...)."""

    graph_capture = False

    def __init__(self, program: Program, state: dict[str, np.ndarray], on_nonfinite: str) -> None:
        self.program, self.state, self.on_nonfinite = program, state, on_nonfinite
        self.session = program.session
        self.where = program.where

    def __getattr__(self, name: str) -> Any:
        return getattr(self.program, name)

    @property
    def required(self) -> list[FeedSpec]:
        return list(self.program.feeds)

    @property
    def optional(self) -> list[FeedSpec]:
        return program_feeds(self.program)[1]

    @property
    def rate_defaults(self) -> Mapping[str, np.ndarray | None]:
        return self.program.analysis.rate_defaults

    @property
    def writes(self) -> list[str]:
        return list(self.program.analysis.binding)

    @property
    def cut_nodes(self) -> list[onnx.NodeProto]:
        return self.program.cut_nodes

    def run(self, feeds: Mapping[str, Any], rates: float | Mapping[str, float] | None = None,
            then: Callable[[bool], None] | None = None) -> dict[str, np.ndarray]:
        return run_program(self.program, feeds, rates, self.state, self.on_nonfinite, then)[0]


class FusedUpdate:
    """The fused (``fast=True``) or native in-graph (``fast=False``) strategy over host arrays.

    Args:
        memory: the session's host memory (its ``arrays`` the state variables).
        protos: the state variables' initializers.
        meta: the builder's metadata.
        trainable: the trained parameters (laid out as one buffer when they can be).
        zero_filled: state variables whose initial value is a fill of zeros.
        fast: cut the optimizer nodes (fused kernels) or keep them in the graph (native kernels).
        on_nonfinite: the session's policy for a non-finite loss.
        options: makes fresh onnxruntime options for one session.
        providers: the execution providers.
        large: the model is large (its detached constants bound as inputs, read in place).
    """

    def __init__(self, memory: HostMemory, protos: Mapping[str, onnx.TensorProto], meta: TrainingMetadata,
                 trainable: Sequence[str], zero_filled: frozenset, fast: bool, on_nonfinite: str,
                 options: Callable[[], ort.SessionOptions], providers: Sequence[Any], large: bool) -> None:
        self.memory, self.protos, self.meta = memory, protos, meta
        self.trainable, self.zero_filled = list(trainable), zero_filled
        self.fast, self.on_nonfinite, self.options, self.providers, self.large = \
            fast, on_nonfinite, options, providers, large
        self.name = "fused" if fast else "native"

    def open_steps(self, model: LargeModel, first: bool) -> list[FusedProgram]:
        """One program per TrainingInfoProto, bound to the state. ``fast=False``: the native
        optimizers write the state in place (guarded against a non-finite loss unless it is
        ignored; a guarded step is redone by a copying twin). ``first``: the programs lay the
        state out (each cut node's flat, then the trainables as one buffer if still apart:
        ``get_flat_parameters`` without a copy); later ones find it laid out."""
        state = self.memory.arrays
        built = [build_program(model, i, state, self.protos, self.meta, self.fast)
                 for i in range(len(model.model_proto.training_info))]
        for _, analysis in built:  # before anything binds a state array: lay the cut state out flat
            analysis.cut.lay_out(state, first, self.zero_filled)
        if first:
            lay_out_flat(state, [n for n in self.trainable if n in state])
        programs = []
        for graph, analysis in built:
            program = open_program(graph, analysis, state, self.options(), self.providers, in_place=not self.fast,
                                   guard=self.on_nonfinite != "ignore", constants_as_inputs=self.large)
            if program.guarded:
                program.fallback = functools.partial(self._copying_program, program.index, model)
            programs.append(FusedProgram(program, state, self.on_nonfinite))
        # the fused loops compile (or load from numba's cache) when the first step plans the cut
        # updates, announced: only those this model's tensors run, not every specialization
        return programs

    def _copying_program(self, index: int, model: LargeModel) -> Program:
        """Program ``index`` of ``model`` without in-place writes: it redoes a step the guard stopped."""
        graph, analysis = build_program(model, index, self.memory.arrays, self.protos, self.meta, False)
        return open_program(graph, analysis, self.memory.arrays, self.options(), self.providers)

    def open_evaluation(self, model: LargeModel) -> FusedProgram:
        state = self.memory.arrays
        graph, analysis = build_program(model, 0, state, self.protos, self.meta, False, prune_inputs=True,
                                        where="evaluate")
        return FusedProgram(open_program(graph, analysis, state, self.options(), self.providers), state, "ignore")

    def open_stages(self, stages: Stages, protos: Mapping[str, onnx.TensorProto],
                    arrays: Mapping[str, np.ndarray]) -> list[FusedProgram]:
        state = {**self.memory.arrays, **self.memory.extra}
        # the apply stage computes no loss: a loss the main graph outputs (a model built on its
        # own "loss" output) would pull the forward pass, and its feeds, into optimizer_step
        apply_meta = self.meta.without_loss()
        programs = []
        for stage in (stages.backward, stages.apply):
            backward = stage is stages.backward
            derived = LargeModel(stage, dict(arrays)).with_proto(stage)
            graph, analysis = build_program(derived, 0, state, protos, self.meta if backward else apply_meta,
                                            self.fast, prune_inputs=True,
                                            where="backward" if backward else "optimizer_step")
            analysis.cut.lay_out(state, rehome=False)
            program = open_program(graph, analysis, state, self.options(), self.providers,
                                   in_place=not self.fast and not backward)
            programs.append(FusedProgram(program, state, self.on_nonfinite if backward else "ignore"))
        return programs


__all__ = ["FusedProgram", "FusedUpdate"]
