"""Gradient accumulation: ``backward`` adds a batch's gradients, ``optimizer_step`` applies them.

The training model is split at its Gradient node (:mod:`.stages`) into a backward program,
which adds the gradients times a scale into accumulators, and an apply program (clipping,
weight decay, the optimizers, T + 1) that reads them. The accumulators are views into one
flat buffer per dtype, so the gradients of a step are one block to all-reduce or inspect.
Both programs are made on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..storage.large_model import LargeModel
from ..storage.tensors import tensor_value
from .binding import open_program
from .program import Program, build_program
from .stages import GRAD_SCALE, Stages, split_stages
from .step import run_program


class GradientAccumulation:
    """The backward and apply programs of one model over the session's state, and the count of
    batches the accumulators hold."""

    def __init__(self, model: LargeModel, state: dict[str, np.ndarray],
                 protos: Mapping[str, onnx.TensorProto], meta: Mapping[str, str], fast: bool,
                 options: Callable[[], ort.SessionOptions], providers: Sequence[Any]) -> None:
        self._model, self._state, self._protos, self._meta = model, state, protos, meta
        self._fast, self._options, self._providers = fast, options, providers
        self._built: tuple[Program, Program, Stages, dict[str, np.ndarray]] | None = None
        self.accumulators: dict[str, np.ndarray] = {}
        self.buffers: list[np.ndarray] = []
        self.count = 0

    def programs(self) -> tuple[Program, Program, Stages, dict[str, np.ndarray]]:
        """(backward program, apply program, the stages, state + accumulators), made once."""
        if self._built is None:
            arrays = dict(self._model.large_initializers)
            stages = split_stages(self._model.model_proto, arrays)
            protos = dict(self._protos)
            for t in stages.backward.training_info[0].algorithm.initializer:
                if t.name in stages.buffers:
                    protos[t.name] = t
            self.accumulators, self.buffers = flat_accumulators(
                {name: tensor_value(protos[name], arrays) for name in stages.buffers})
            state = {**self._state, **self.accumulators}
            programs = []
            # the apply stage computes no loss: a loss the main graph outputs (a model built on its
            # own "loss" output) would pull the forward pass, and its feeds, into optimizer_step
            apply_meta = {k: v for k, v in self._meta.items() if k not in ("loss", "eval_loss")}
            for stage in (stages.backward, stages.apply):
                backward = stage is stages.backward
                derived = LargeModel(stage, arrays).with_proto(stage)
                graph, analysis = build_program(derived, 0, state, protos, self._meta if backward else apply_meta,
                                                self._fast, prune_inputs=True,
                                                where="backward" if backward else "optimizer_step")
                analysis.cut.lay_out(state, rehome=False)
                programs.append(open_program(graph, analysis, state, self._options(), self._providers,
                                             in_place=not self._fast and not backward))
            self._built = (programs[0], programs[1], stages, state)
        return self._built

    @property
    def built(self) -> bool:
        return self._built is not None

    def backward(self, feeds: Mapping[str, Any], scale: float, on_nonfinite: str,
                 then: Callable[[bool], None]) -> dict[str, np.ndarray]:
        """Add ``scale`` times this batch's gradients; the outputs. The count, and the
        caller's ``then(skipped)``, land inside the state write (Ctrl-C cannot split them)."""
        backward, _, _, state = self.programs()

        def counted(skipped: bool) -> None:
            if not skipped:
                self.count += 1
            then(skipped)

        result, _ = run_program(backward, {**feeds, GRAD_SCALE: np.array(scale, np.float64)}, None,
                                state, on_nonfinite, counted)
        return result

    def apply(self, rates, then: Callable[[], None]) -> dict[str, np.ndarray]:
        """Run the apply program on the accumulated gradients; zeroing them and the caller's
        ``then()`` (the schedule's step) land inside the state write, with T."""
        _, apply, _, state = self.programs()

        def applied(_skipped: bool) -> None:
            self.zero()
            then()

        result, _ = run_program(apply, {}, rates, state, "ignore", applied)
        return result

    def zero(self) -> None:
        for acc in self.accumulators.values():
            acc.fill(0)
        self.count = 0

    def gradients(self) -> dict[str, np.ndarray]:
        _, _, stages, state = self.programs()
        return {param: state[acc].copy() for param, acc in stages.gradients.items()}

    def views(self) -> list[tuple[str, np.ndarray]]:
        _, _, stages, state = self.programs()
        return [(param, state[name]) for param, name in stages.views]


def flat_accumulators(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Copies of ``arrays`` as views into one flat buffer per dtype (name order kept), and
    the buffers: the gradients of a step are one contiguous block to reduce or inspect."""
    by_dtype: dict[np.dtype, list[str]] = {}
    for name, array in arrays.items():
        by_dtype.setdefault(array.dtype, []).append(name)
    views, buffers = {}, []
    for dtype, names in by_dtype.items():
        flat = np.empty(sum(arrays[n].size for n in names), dtype)
        offset = 0
        for name in names:
            size = arrays[name].size
            views[name] = flat[offset:offset + size].reshape(arrays[name].shape)
            views[name][...] = arrays[name]
            offset += size
        buffers.append(flat)
    return {name: views[name] for name in arrays}, buffers
