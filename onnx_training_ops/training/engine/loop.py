"""The engine's loop part: steps, evaluation, gradient accumulation, learning rates, counters.

:class:`TrainingLoop` runs the programs of :class:`~.programs.SessionPrograms` on the state,
whatever strategies opened them (:mod:`.protocols`): ``step``; ``evaluate`` (eval-mode loss,
nothing changes); ``backward``/``optimizer_step``/``zero_grad`` (:mod:`.accumulation`); the
learning rates and schedule (:mod:`..options.rates`) and the count of skipped steps. Each program
writes the state and calls the loop's bookkeeping (counters, schedule position, accumulated
count) inside one Ctrl-C hold: both land, or neither does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import TrainingOpError
from ...kernels.compile_notice import announced_on_first_call
from ..graphs.stages import GRAD_SCALE
from ..inputs.checks import label_mismatch
from ..inputs.feeds import checked_learning_rate
from ..options.rates import LearningRates
from .accumulation import GradientAccumulation
from .programs import SessionPrograms


class TrainingLoop:
    """What changes the state step by step, over one store and its programs.

    Args:
        programs: the session's programs (and through them its state store and metadata).
    """

    def __init__(self, programs: SessionPrograms) -> None:
        self.programs = programs
        self.store = programs.store
        self.meta = programs.meta
        defaults: dict[str, Any] = {}
        for program in programs.steps:
            for name, value in program.rate_defaults.items():
                defaults.setdefault(name, value)
        self.rates = LearningRates(defaults, self.meta)
        self.accumulation = GradientAccumulation(programs)
        self.skipped_steps = 0

    # ------------------------------------------------------------------ steps

    @announced_on_first_call
    def step(self, feeds: Mapping[str, Any], lr: Any, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One training step (``TrainingSession.step``): each program in order, the optimizer step
        counted if none was skipped."""
        self.store.check_filled("step")
        if self.accumulation.count:  # with gradients accumulated: backward then optimizer_step, as in torch
            if outputs:
                raise TrainingOpError("step(outputs=...) with gradients accumulated by backward(): call "
                                      "optimizer_step() first, or evaluate(feeds, outputs=...)")
            accumulated = self.backward(feeds)
            accumulated.update(self.optimizer_step(lr))
            return accumulated
        programs = self.programs
        programs.check_feeds(feeds, programs.required_names, programs.optional)
        rates = self.rates.for_step(lr)
        steps = programs.for_step(tuple(outputs))
        count, count_last = self.step_counters()
        result: dict[str, np.ndarray] = {}
        for program in steps:
            try:
                result.update(program.run(feeds, rates, count_last if program is steps[-1] else count))
            except TrainingOpError as error:
                programs.explain_failure(feeds, "step", error)
        return result

    def step_counters(self) -> tuple[Callable[[bool], None], Callable[[bool], None]]:
        """(count, count_last): each program of a step reports whether it was skipped (inside
        its state write); the optimizer step counts, on the last, if none of them was."""
        applied = [True]

        def count(skipped: bool) -> None:
            if skipped:
                self.skipped_steps += 1
                applied[0] = False

        def count_last(skipped: bool) -> None:
            count(skipped)
            if applied[0]:
                self.rates.advance()

        return count, count_last

    def count_skipped(self, skipped: bool) -> None:
        if skipped:
            self.skipped_steps += 1

    # ------------------------------------------------------------------ evaluation

    @announced_on_first_call
    def evaluate(self, feeds: Mapping[str, Any], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """The loss and ``outputs`` with the current weights (``TrainingSession.evaluate``)."""
        self.store.check_filled("evaluate")
        layout = self.meta.label_shape or {}
        # the loss's output, watched when the labels' shape is not all known before the run
        # (onnxruntime's SoftmaxCrossEntropyLoss returned a number for labels [2, 8] against logits [2, 16, V])
        watch = layout.get("output") if any(not isinstance(d, int) for d in layout.get("shape", ())) else None
        extra = (watch,) if watch and watch not in outputs else ()
        program = self.programs.for_evaluation(tuple(outputs) + extra)
        self.programs.check_feeds(feeds, {s.name for s in program.required}, {s.name for s in program.optional},
                                  "evaluate")
        try:
            result = program.run(feeds)
        except TrainingOpError as error:
            self.programs.explain_failure(feeds, "evaluate", error)
        if watch:
            message = label_mismatch(self.meta, feeds, (result.pop(watch) if extra else result[watch]).shape,
                                     "evaluate")
            if message:
                raise TrainingOpError(message)
        eval_loss, loss = self.meta.eval_loss, ",".join(self.meta.loss)
        if eval_loss and loss and eval_loss in result and loss not in outputs:  # the eval-mode loss, under its name
            result[loss] = result.pop(eval_loss)
        return result

    # ------------------------------------------------------------------ accumulation

    @announced_on_first_call
    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        """Add this batch's gradients times ``scale`` (``TrainingSession.backward``)."""
        self.store.check_filled("backward")
        backward = self.accumulation.programs()[0]
        self.programs.check_feeds(feeds, {s.name for s in backward.required} - {GRAD_SCALE},
                                  {s.name for s in backward.optional}, "backward")
        scale = checked_learning_rate(scale, "backward: scale")
        try:
            return self.accumulation.backward(feeds, scale, self.count_skipped)
        except TrainingOpError as error:
            self.programs.explain_failure(feeds, "backward", error)
            raise

    @announced_on_first_call
    def optimizer_step(self, lr: Any = None) -> dict[str, np.ndarray]:
        """Apply the accumulated gradients, then zero them (``TrainingSession.optimizer_step``)."""
        if not self.accumulation.count:
            raise TrainingOpError("optimizer_step: no gradients accumulated since the last optimizer "
                                  "step; call backward(feeds) first")
        return self.accumulation.apply(self.rates.for_step(lr), self.rates.advance)

    def buffer_names(self) -> list[str]:
        """State the backward stage updates from the batch (BatchNorm running statistics)."""
        backward = self.accumulation.programs()[0]
        return [k for k in backward.writes if k in self.store.arrays]

    def sessions(self) -> list[Any]:
        """The onnxruntime sessions of the backward and apply stages, once opened."""
        if not self.accumulation.built:
            return []
        backward, apply = self.accumulation.programs()[:2]
        return [backward.session, apply.session]


__all__ = ["TrainingLoop"]
