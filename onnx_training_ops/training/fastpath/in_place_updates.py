"""Updates a program applies to the state itself, cut out of the graph onnxruntime runs.

:class:`InPlaceUpdate` is what the step (:mod:`..graphs.step`) and the binding (:mod:`..graphs.binding`) see;
its implementations are the fast path's optimizer nodes (:class:`CutNodes`, :mod:`.fast_path`),
lazy table rows (:class:`RowUpdates`, :mod:`.row_updates`) and RMSProp (:class:`RMSPropUpdates`,
:mod:`.rmsprop_fast_path`). Analysis (:func:`~..graphs.program.build_program`) finds each one's nodes
and where its inputs come from (:mod:`.sources`); after the program's first run,
:meth:`InPlaceUpdate.prepare` plans the update over the preallocated output buffers and the
state arrays; every step then calls :meth:`InPlaceUpdate.apply` inside the state write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

import numpy as np
import onnx

from .fast_path import (
    CutStep,
    FlatNode,
    apply_plan,
    apply_step_with_feeds,
    cut_plan,
    flat_gradient_views,
    flatten_cut_state,
    prepare_plan,
)
from .rmsprop_fast_path import apply_rmsprop
from .rmsprop_fast_path import plan as rmsprop_plan
from .row_updates import apply_row_groups
from .row_updates import plan as row_plan
from .sources import FromFeed, Source

Values = Callable[[Mapping[str, Source]], Mapping[str, Any]]
"""Resolves sources to this step's values (outputs of the run, state, feeds, fixed arrays)."""


class InPlaceUpdate(ABC):
    """One family of updates applied in place after onnxruntime's run.

    Attributes:
        nodes: the nodes cut out of the graph for it.
        sources: where each value it reads comes from.
    """

    nodes: list[onnx.NodeProto]
    sources: dict[str, Source]

    @cached_property
    def reads_feeds(self) -> bool:
        """Whether a value it reads is a feed of the step (resolved per step)."""
        return any(isinstance(src, FromFeed) for src in self.sources.values())

    @property
    @abstractmethod
    def planned(self) -> bool:
        """Whether :meth:`prepare` planned any update (else :meth:`apply` has nothing to do)."""

    @abstractmethod
    def prepare(self, fixed_buffers: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]) -> None:
        """After the first run: plan the update over the run's preallocated outputs and the state."""

    @abstractmethod
    def apply(self, values: Values, feeds: Mapping[str, Any]) -> None:
        """Apply it in place (``values`` resolves its sources; ``feeds``: the step's, defaults filled)."""


class CutNodes(InPlaceUpdate):
    """The fast path's optimizer nodes of the training domain (:mod:`.fast_path`)."""

    def __init__(self, nodes: list[onnx.NodeProto], sources: dict[str, Source], prescale: dict[str, str],
                 gate: str | None = None) -> None:
        self.nodes, self.sources, self.prescale = nodes, sources, prescale
        self.gate = gate  # a bool output of the run: apply only where it is true (:mod:`.gated_updates`)
        self.gate_buffer: np.ndarray | None = None
        self.flat: dict[int, FlatNode] = {}  # position in nodes -> its flat layout (lay_out)
        self.plan: list[CutStep] = []

    def lay_out(self, state: dict[str, np.ndarray], rehome: bool, zeros: frozenset = frozenset()) -> None:
        """Before anything binds the state: each node's X, V, H as views into one flat buffer per
        role (``rehome=False``: only where the state already is laid out so)."""
        self.flat = flatten_cut_state(self.nodes, self.sources, state, rehome=rehome, prescale=self.prescale,
                                      zeros=zeros)

    def gradient_views(self, values: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The flat nodes' gradients as views of their G buffers (:func:`.fast_path.flat_gradient_views`)."""
        return flat_gradient_views(self.flat, values)

    def drop_gradient_buffers(self) -> None:
        """Forget the G buffers made before the first run (a gradient not shaped like its X)."""
        for entry in self.flat.values():
            entry.buffers.pop("G", None)

    @property
    def planned(self) -> bool:
        return bool(self.plan)

    def prepare(self, fixed_buffers: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]) -> None:
        self.plan = cut_plan(self.nodes, self.flat, self.sources, fixed_buffers, state, self.prescale)
        self.gate_buffer = fixed_buffers[self.gate] if self.gate is not None else None
        if not self.reads_feeds:
            prepare_plan(self.plan)

    def apply(self, values: Values, feeds: Mapping[str, Any]) -> None:
        if self.gate is not None:
            flag = self.gate_buffer
            if flag is None:
                flag = values({self.gate: self.sources[self.gate]})[self.gate]
            if not bool(flag):
                return
        if not self.reads_feeds:
            apply_plan(self.plan)
            return
        for step in self.plan:
            apply_step_with_feeds(step, feeds)


class _GroupUpdates(InPlaceUpdate):
    """Updates a fused kernel applies group by group: ``make_plans(groups, state)`` once the
    buffers exist, then ``run(plans, inputs)`` each step."""

    make_plans: Callable[[list, Mapping[str, np.ndarray]], list]
    run: Callable[[list, Mapping[str, Any]], None]

    def __init__(self, groups: list, sources: dict[str, Source]) -> None:
        self.groups, self.sources = groups, sources
        self.nodes = [n for g in groups for n in g.nodes]
        self.plans: list = []

    @property
    def planned(self) -> bool:
        return bool(self.plans)

    def prepare(self, fixed_buffers: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]) -> None:
        self.plans = type(self).make_plans(self.groups, state)

    def apply(self, values: Values, feeds: Mapping[str, Any]) -> None:
        type(self).run(self.plans, values(self.sources))


class RowUpdates(_GroupUpdates):
    """Lazy updates of an embedding table's touched rows (:mod:`.row_updates`): ``RowGroup``s
    planned into ``RowPlan``s."""

    make_plans = staticmethod(row_plan)
    run = staticmethod(apply_row_groups)


class RMSPropUpdates(_GroupUpdates):
    """RMSProp updates (standard ops in the graph) applied by the fused kernel
    (:mod:`.rmsprop_fast_path`): ``RMSPropGroup``s planned into ``RMSPropPlan``s."""

    make_plans = staticmethod(rmsprop_plan)
    run = staticmethod(apply_rmsprop)
