"""Gradient accumulation: ``backward`` adds a batch's gradients, ``optimizer_step`` applies them.

The training model is split at its Gradient node (:mod:`..graphs.stages`) into a backward program,
which adds the gradients times a scale into accumulators, and an apply program (clipping,
weight decay, the optimizers, T + 1) that reads them. The accumulators live in the session's
memory beside the state, as slices of one flat buffer per dtype (:meth:`~.memory.StateMemory.add_flat`),
so the gradients of a step are one block to all-reduce, inspect or zero. Both programs are
made on first use, by the session's update strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import TrainingOpError
from ...interrupts import held_interrupts
from ...storage.large_model import LargeModel
from ...storage.tensors import tensor_value
from ..graphs.stages import GRAD_SCALE, Stages, split_stages
from .programs import SessionPrograms
from .protocols import EngineProgram


class GradientAccumulation:
    """The backward and apply programs of one model over the session's memory, the accumulators
    and the count of batches they hold."""

    def __init__(self, programs: SessionPrograms) -> None:
        self._programs = programs
        self._built: tuple[EngineProgram, EngineProgram, Stages, dict[str, np.ndarray]] | None = None
        self.flat: list[Any] = []  # one buffer per dtype (numpy arrays in host memory, OrtValues on a device)
        self.count = 0

    def programs(self) -> tuple[EngineProgram, EngineProgram, Stages, dict[str, np.ndarray]]:
        """(backward program, apply program, the stages, the accumulators' host arrays (host
        memory; else empty)), made once."""
        if self._built is None:
            store = self._programs.store
            model: LargeModel = store.model
            arrays = dict(model.large_initializers)
            stages = split_stages(model.model_proto, arrays)
            protos = dict(store.protos)
            for t in stages.backward.training_info[0].algorithm.initializer:
                if t.name in stages.buffers:
                    protos[t.name] = t
            memory = store.memory
            self.flat = memory.add_flat({name: tensor_value(protos[name], arrays) for name in stages.buffers})
            backward, apply = self._programs.update.open_stages(stages, protos, arrays)
            extra = getattr(memory, "extra", {})
            self._built = (backward, apply, stages, {n: extra[n] for n in stages.buffers if n in extra})
        return self._built

    @property
    def built(self) -> bool:
        return self._built is not None

    @property
    def accumulators(self) -> dict[str, np.ndarray]:
        """Each accumulator's live host array (host memory)."""
        return self.programs()[3]

    @property
    def buffers(self) -> list[np.ndarray]:
        """The flat host buffers the accumulators are views of (host memory only)."""
        self.programs()
        self._host_only("gradient_buffers")
        return list(self.flat)

    @property
    def exported(self) -> list[Any]:
        """The flat buffers in either memory, as DLPack exporters (numpy arrays, or OrtValues on
        a device): what a collective reduces in place."""
        self.programs()
        return list(self.flat)

    def layout(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """(parameter, index of its flat buffer, element offset, shape) of each accumulator, in
        :meth:`views`' order, in either memory (the same on every process that opens the model)."""
        stages = self.programs()[2]
        memory = self._programs.store.memory
        index = {id(buffer): i for i, buffer in enumerate(self.flat)}
        out = []
        for param, name in stages.views:
            buffer, offset = memory.located(name)
            out.append((param, index[id(buffer)], offset, tuple(memory.shape(name))))
        return out

    def _host_only(self, what: str) -> None:
        store = self._programs.store
        if not store.live:
            raise TrainingOpError(f"{what}: the accumulated gradients live on the device "
                                  f"({store.memory.device!r}); use gradients() for copies, gradient_tensors() "
                                  "to share them (DLPack)")

    def backward(self, feeds: Mapping[str, Any], scale: float, then: Callable[[bool], None]) -> dict[str, np.ndarray]:
        """Add ``scale`` times this batch's gradients; the outputs. The count, and the
        caller's ``then(skipped)``, land inside the state write (Ctrl-C cannot split them)."""
        backward = self.programs()[0]
        spec = next(s for s in backward.required if s.name == GRAD_SCALE)

        def counted(skipped: bool) -> None:
            if not skipped:
                self.count += 1
            then(skipped)

        return backward.run({**feeds, GRAD_SCALE: np.array(scale, spec.dtype)}, None, counted)

    def apply(self, rates: Any, then: Callable[[], None]) -> dict[str, np.ndarray]:
        """Run the apply program on the accumulated gradients; zeroing them and the caller's
        ``then()`` (the schedule's step) land inside the state write, with T."""
        apply = self.programs()[1]

        def applied(_skipped: bool) -> None:
            self._zero()
            then()

        return apply.run({}, rates, applied)

    def zero(self) -> None:
        """Every accumulator to zero and the count to 0, together (``zero_grad``)."""
        with held_interrupts():
            self._zero()

    def _zero(self) -> None:
        if self.flat:
            self._programs.store.memory.zero(self.flat)
        self.count = 0

    def gradients(self) -> dict[str, np.ndarray]:
        """A copy of each parameter's accumulated gradient."""
        stages = self.programs()[2]
        copies = self._programs.store.memory.download_many(stages.gradients.values())
        return {param: copies[acc] for param, acc in stages.gradients.items()}

    def views(self) -> list[tuple[str, np.ndarray]]:
        """(parameter, live accumulator) pairs (host memory only)."""
        stages, accumulators = self.programs()[2:]
        self._host_only("gradient_views")
        return [(param, accumulators[name]) for param, name in stages.views]


__all__ = ["GradientAccumulation"]
