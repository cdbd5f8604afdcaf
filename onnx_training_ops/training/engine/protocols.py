"""The seams of the engine: a program, and the update strategy that opens programs.

A session opens its programs (the steps, an evaluation, the backward and apply stages of
gradient accumulation) through one :class:`UpdateStrategy`, chosen once from the caller's
options (:mod:`.config`): :class:`~.fused.FusedUpdate` (the fused kernels apply the optimizer
nodes to host arrays after onnxruntime's run, or with ``fast=False`` the native optimizer
kernels write them during it) or :class:`~.graph.GraphUpdate` (the update lowered into the
graph, over any :class:`~.memory.StateMemory`). Every program they open is an
:class:`EngineProgram`: the loop (:mod:`.loop`) and the accumulation (:mod:`.accumulation`)
run them all the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnx

from ...storage.large_model import LargeModel
from ..graphs.stages import Stages
from ..inputs.feeds import FeedSpec


class EngineProgram(Protocol):
    """One onnxruntime graph over the session's state, and what a run does around it."""

    where: str  # the method it runs for, as messages name it ("step", "backward"...)
    session: Any  # its onnxruntime session

    @property
    def required(self) -> list[FeedSpec]:
        """The inputs a run needs."""
        ...

    @property
    def optional(self) -> list[FeedSpec]:
        """The inputs a run may take: learning rates and inputs with a default."""
        ...

    @property
    def rate_defaults(self) -> Mapping[str, np.ndarray | None]:
        """Each learning-rate input's default (None: none)."""
        ...

    @property
    def writes(self) -> list[str]:
        """The state variables a run writes."""
        ...

    @property
    def cut_nodes(self) -> list[onnx.NodeProto]:
        """The optimizer nodes the fused kernels apply after the run."""
        ...

    graph_capture: bool  # whether a run replays a CUDA graph

    def run(self, feeds: Mapping[str, Any], rates: float | Mapping[str, float] | None = None,
            then: Callable[[bool], None] | None = None) -> dict[str, np.ndarray]:
        """One run: the returned values. ``then(skipped)`` runs inside the state's write (a
        Ctrl-C cannot land between them); a non-finite loss follows the program's policy."""
        ...


class UpdateStrategy(Protocol):
    """Where the update runs, and so how a session's programs are made."""

    name: str  # "fused", "native" or "graph"

    def open_steps(self, model: LargeModel, first: bool) -> Sequence[EngineProgram]:
        """One step program per TrainingInfoProto of ``model``. ``first``: the session's own
        steps (the state is laid out for them; the static shapes and fixed addresses apply),
        not the copies returning extra outputs."""
        ...

    def open_evaluation(self, model: LargeModel) -> EngineProgram:
        """The program of an evaluation model (:func:`~..graphs.stages.session_evaluation`): reads only."""
        ...

    def open_stages(self, stages: Stages, protos: Mapping[str, onnx.TensorProto],
                    arrays: Mapping[str, np.ndarray]) -> Sequence[EngineProgram]:
        """(backward, apply) over the state and the accumulators (already in the memory);
        ``protos`` the state's and accumulators' tensors, ``arrays`` the stages' big arrays."""
        ...


__all__ = ["EngineProgram", "UpdateStrategy"]
