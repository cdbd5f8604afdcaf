"""A session's loop part: steps, evaluation, gradient accumulation, learning rates, counters.

:class:`TrainingLoop` runs the programs of :class:`~.session_programs.SessionPrograms` on the
state (:func:`~.step.run_program`): ``step``; ``evaluate`` (eval-mode loss, nothing changes);
``backward``/``optimizer_step``/``zero_grad`` (:mod:`.accumulation`); the learning rates and
schedule (:mod:`.rates`) and the count of skipped steps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import TrainingOpError
from ..kernels.compile_notice import announced_on_first_call
from .accumulation import GradientAccumulation
from .checks import label_mismatch
from .feeds import checked_learning_rate
from .program import program_feeds
from .rates import LearningRates
from .session_programs import SessionPrograms
from .stages import GRAD_SCALE
from .step import run_program


class LoopSteps:
    """The bookkeeping every loop shares (host arrays or device state): a step over accumulated
    gradients, the skip and schedule counters of a step's programs, what evaluation watches.
    A loop sets ``store``, ``meta``, ``rates``, ``accumulation`` and ``skipped_steps``."""

    store: Any
    meta: Mapping[str, str]
    rates: LearningRates
    accumulation: Any
    skipped_steps: int

    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def optimizer_step(self, lr: Any = None) -> dict[str, np.ndarray]:
        raise NotImplementedError

    programs: Any

    def run_step(self, program: Any, feeds: Mapping[str, Any], rates: Any,
                 then: Callable[[bool], None]) -> dict[str, np.ndarray]:
        """Run one step program; its returned values."""
        raise NotImplementedError

    @announced_on_first_call
    def step(self, feeds: Mapping[str, Any], lr: Any, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One training step (``TrainingSession.step``): each program in order, the optimizer step
        counted if none was skipped."""
        self.store.check_filled("step")
        accumulated = self.accumulated_step(feeds, lr, outputs)
        if accumulated is not None:
            return accumulated
        self.programs.check_feeds(feeds, self.programs.required_names, self.programs.optional)
        rates = self.rates.for_step(lr)
        programs = self.programs.for_step(tuple(outputs))
        count, count_last = self.step_counters()
        result: dict[str, np.ndarray] = {}
        for program in programs:
            result.update(self.run_step(program, feeds, rates, count_last if program is programs[-1] else count))
        return result

    def accumulated_step(self, feeds: Mapping[str, Any], lr: Any, outputs: Sequence[str]) -> dict | None:
        """With gradients accumulated, ``step`` is backward then optimizer_step (as in torch);
        None when none are."""
        if not self.accumulation.count:
            return None
        if outputs:
            raise TrainingOpError("step(outputs=...) with gradients accumulated by backward(): call "
                                  "optimizer_step() first, or evaluate(feeds, outputs=...)")
        result = self.backward(feeds)
        result.update(self.optimizer_step(lr))
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

    def evaluation_outputs(self, outputs: Sequence[str]) -> tuple[str | None, tuple[str, ...]]:
        """(the loss's output to watch, the outputs to add for it): when the labels' shape is not
        all known before the run (onnxruntime's SoftmaxCrossEntropyLoss returned a number for
        labels [2, 8] against logits [2, 16, V])."""
        layout = json.loads(self.meta.get("label_shape") or "{}")
        watch = layout.get("output") if any(not isinstance(d, int) for d in layout.get("shape", ())) else None
        return watch, ((watch,) if watch and watch not in outputs else ())

    def evaluated(self, feeds: Mapping[str, Any], result: dict, watch: str | None, extra: tuple[str, ...],
                  outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """An evaluation's result: the labels checked against the watched output, the eval-mode
        loss under the loss's name."""
        if watch:
            message = label_mismatch(self.meta, feeds, (result.pop(watch) if extra else result[watch]).shape,
                                     "evaluate")
            if message:
                raise TrainingOpError(message)
        eval_loss, loss = self.meta.get("eval_loss"), self.meta.get("loss")
        if eval_loss in result and loss not in outputs:  # the eval-mode loss, under the loss's name
            result[loss] = result.pop(eval_loss)
        return result

    def check_accumulated(self) -> None:
        if not self.accumulation.count:
            raise TrainingOpError("optimizer_step: no gradients accumulated since the last optimizer "
                                  "step; call backward(feeds) first")


class TrainingLoop(LoopSteps):
    """What changes the state step by step, over one store and its programs."""

    def __init__(self, programs: SessionPrograms) -> None:
        """The loop over ``programs``: learning rates from their inputs, no gradients accumulated.

        Args:
            programs: the session's programs (and through them its state store and metadata).
        """
        self.programs = programs
        self.store = programs.store
        self.meta = programs.meta
        self.on_nonfinite = programs.config.on_nonfinite
        self.rates = LearningRates(programs.steps, self.meta)
        self.accumulation = GradientAccumulation(self.store.model, self.store.arrays, self.store.protos, self.meta,
                                                 programs.config.fast, programs.options, programs.config.providers)
        self.skipped_steps = 0

    def run_step(self, program: Any, feeds: Mapping[str, Any], rates: Any,
                 then: Callable[[bool], None]) -> dict[str, np.ndarray]:
        try:
            return run_program(program, feeds, rates, self.store.arrays, self.on_nonfinite, then)[0]
        except TrainingOpError as error:
            self.programs.explain_failure(feeds, "step", error)
            raise

    @announced_on_first_call
    def evaluate(self, feeds: Mapping[str, Any], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """The loss and ``outputs`` with the current weights (``TrainingSession.evaluate``)."""
        self.store.check_filled("evaluate")
        watch, extra = self.evaluation_outputs(outputs)
        program = self.programs.for_evaluation(tuple(outputs) + extra)
        required, optional = program_feeds(program)
        self.programs.check_feeds(feeds, {f.name for f in required}, {f.name for f in optional}, "evaluate")
        try:
            result, _ = run_program(program, feeds, None, self.store.arrays, "ignore")
        except TrainingOpError as error:
            self.programs.explain_failure(feeds, "evaluate", error)
        return self.evaluated(feeds, result, watch, extra, outputs)

    @announced_on_first_call
    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        """Add this batch's gradients times ``scale`` (``TrainingSession.backward``)."""
        self.store.check_filled("backward")
        backward = self.accumulation.programs()[0]
        required, optional = program_feeds(backward)
        self.programs.check_feeds(feeds, {f.name for f in required} - {GRAD_SCALE}, {f.name for f in optional},
                                  "backward")
        scale = checked_learning_rate(scale, "backward: scale")
        try:
            return self.accumulation.backward(feeds, scale, self.on_nonfinite, self.count_skipped)
        except TrainingOpError as error:
            self.programs.explain_failure(feeds, "backward", error)

    @announced_on_first_call
    def optimizer_step(self, lr: Any = None) -> dict[str, np.ndarray]:
        """Apply the accumulated gradients, then zero them (``TrainingSession.optimizer_step``)."""
        self.check_accumulated()
        return self.accumulation.apply(self.rates.for_step(lr), self.rates.advance)

    def buffer_names(self) -> list[str]:
        """State the backward stage updates from the batch (BatchNorm running statistics)."""
        backward = self.accumulation.programs()[0]
        return [k for k in backward.analysis.binding if k in self.store.arrays]

    def sessions(self) -> list[Any]:
        """The onnxruntime sessions of the backward and apply stages, once opened."""
        if not self.accumulation.built:
            return []
        backward, apply, _, _ = self.accumulation.programs()
        return [backward.session, apply.session]
