"""Part of :class:`~onnx_training_ops.TrainingSession`: the training loop in torch's vocabulary.

``evaluate`` (eval-mode loss, nothing changes), ``backward``/``optimizer_step``/``zero_grad``
(gradient accumulation, :mod:`.accumulation`), ``gradients`` and the flat gradient buffers
collectives reduce, and the learning-rate schedule (:mod:`.rates`).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import TrainingOpError
from ..storage.tensors import proto_of
from .binding import open_program
from .checks import label_mismatch
from .feeds import Feed, checked_learning_rate, feed_list
from .locked import locked
from .program import Program, build_program, program_feeds
from .stages import GRAD_SCALE, evaluation_model
from .step import run_program


class TrainingLoop:
    """A mixin of TrainingSession (``self._accumulation``, ``self._rates``, ``self._state``...)."""

    # ------------------------------------------------------------------ evaluation

    @locked
    def eval_feeds(self, outputs: Sequence[str] = ()) -> list[Feed]:
        """What :meth:`evaluate` takes (for the same ``outputs``).

        Args:
            outputs: the extra outputs :meth:`evaluate` would be asked for.

        Returns:
            One entry per input: name, dtype, shape and whether it is optional.
        """
        return feed_list(*program_feeds(self._eval_program(tuple(outputs))))

    @locked
    def evaluate(self, feeds: Mapping[str, Any], outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The loss and ``outputs`` with the current weights; nothing changes.

        The loss of a ``mode="train"`` model is its eval-mode loss (dropout off, BatchNorm
        running statistics), bit-equal to a step's in eval mode.

        Args:
            feeds: the inputs of the model and the loss (e.g. ``input`` and ``labels``).
            outputs: more values to return (any value of the main graph).

        Returns:
            ``{"loss": ..., **outputs}``.

        Raises:
            TrainingOpError: a missing, unknown or mis-shaped feed, or an unknown output.
        """
        self._check_filled("evaluate")
        # the loss's output too, when the labels' shape is not all known before the run: onnxruntime's
        # SoftmaxCrossEntropyLoss returned a number for labels [2, 8] against logits [2, 16, V]
        layout = json.loads(self._meta.get("label_shape") or "{}")
        watch = layout.get("output") if any(not isinstance(d, int) for d in layout.get("shape", ())) else None
        extra = (watch,) if watch and watch not in outputs else ()
        program = self._eval_program(tuple(outputs) + extra)
        required, optional = program_feeds(program)
        self._check_feeds(feeds, {f.name for f in required}, {f.name for f in optional}, "evaluate")
        try:
            result, _ = run_program(program, feeds, None, self._state, "ignore")
        except TrainingOpError as error:
            self._explain_failure(feeds, "evaluate", error)
        if watch:
            message = label_mismatch(self._meta, feeds, (result.pop(watch) if extra else result[watch]).shape,
                                     "evaluate")
            if message:
                raise TrainingOpError(message)
        eval_loss, loss = self._meta.get("eval_loss"), self._meta.get("loss")
        if eval_loss in result and loss not in outputs:  # the eval-mode loss, under the loss's name
            result[loss] = result.pop(eval_loss)
        return result

    def _eval_program(self, outputs: tuple[str, ...]) -> Program:
        if outputs not in self._eval_programs:
            loss = self._meta.get("eval_loss") or self._meta.get("loss", "")
            if not loss and not outputs:
                raise TrainingOpError("evaluate: the model names no loss (metadata 'loss'); pass outputs=[...]")
            proto = self._model.model_proto
            derived = evaluation_model(proto, loss, list(outputs)) if loss else \
                evaluation_model(proto, outputs[0], list(outputs[1:]))
            derived = self._model.with_proto(derived)
            program = build_program(derived, 0, self._state, self._state_protos, self._meta, False,
                                    prune_inputs=True)
            program.where = "evaluate"
            self._eval_programs[outputs] = open_program(program, self._state, self._session_options(),
                                                        self._providers)
        return self._eval_programs[outputs]

    def _explain_failure(self, feeds: Mapping[str, Any], where: str, error: TrainingOpError) -> None:
        """Re-raise ``error``, or, when the labels do not fit what the loss's output is for this
        batch (run the main graph to know), a one-line feed error instead of onnxruntime's."""
        output = json.loads(self._meta.get("label_shape") or "{}").get("output")
        if output and "onnxruntime failed" in str(error):
            try:
                data = {k: v for k, v in feeds.items() if k in {vi.name for vi in proto_of(self._model).graph.input}}
                message = label_mismatch(self._meta, feeds, self.run([output], data)[0].shape, where)
            except Exception:  # noqa: BLE001 - the forward pass fails too: onnxruntime's error stands
                message = ""
            if message:
                raise TrainingOpError(message) from None
        raise error

    # ------------------------------------------------------------------ learning rates

    @property
    def learning_rates(self) -> dict[str, float]:
        """The learning rate of each input for the next optimizer step (schedule or default)."""
        return self._rates.next()

    @property
    def lr_schedule(self):
        """The attached schedule (:mod:`onnx_training_ops.schedules`) or None."""
        return self._rates.schedule

    @property
    def lr_schedule_step(self) -> int:
        """Optimizer steps taken under the schedule (torch's ``scheduler.last_epoch``)."""
        return self._rates.step

    @locked
    def set_lr_schedule(self, schedule, step: int = 0) -> None:
        """Drive every learning-rate input by ``schedule``, saved in checkpoints with its position.

        Each input uses its own default as the base rate, as torch's ``base_lrs``. Schedules are
        not called directly: the session steps them once per optimizer step.

        Args:
            schedule (Schedule | None): one of :mod:`onnx_training_ops.schedules` (``WarmupCosineLR(...)``...), or
                None to detach the current one.
            step: the optimizer step the schedule starts from.

        Raises:
            TrainingOpError: not a schedule, or a negative ``step``.
        """
        self._rates.attach(schedule, step)

    # ------------------------------------------------------------------ gradient accumulation

    def _stage_programs(self):
        return self._accumulation.programs()

    @locked
    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        """Add this batch's gradients (times ``scale``) to the accumulated ones.

        Parameters and optimizer state do not change (BatchNorm running statistics do, as in
        torch's forward). Non-finite losses follow ``on_nonfinite``.

        Args:
            feeds: the algorithm's inputs (the model's inputs and e.g. ``labels``).
            scale: factor on this batch's gradients; for the mean over k micro-batches pass
                ``scale=1/k``, as torch users divide the loss.

        Returns:
            ``{"loss": ...}``: this batch's loss.

        Raises:
            TrainingOpError: a missing, unknown or mis-shaped feed.
            NonFiniteLossError: a NaN or infinite loss with ``on_nonfinite="raise"``.
        """
        self._check_filled("backward")
        backward = self._accumulation.programs()[0]
        required, optional = program_feeds(backward)
        self._check_feeds(feeds, {f.name for f in required} - {GRAD_SCALE}, {f.name for f in optional}, "backward")
        scale = checked_learning_rate(scale, "backward: scale")
        try:
            return self._accumulation.backward(feeds, scale, self.on_nonfinite, self._count_skipped)
        except TrainingOpError as error:
            self._explain_failure(feeds, "backward", error)

    def _count_skipped(self, skipped: bool) -> None:
        if skipped:
            self.skipped_steps += 1

    @locked
    def optimizer_step(self, lr: float | Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """Apply the accumulated gradients (clipping, weight decay, the optimizer, T + 1), then zero them.

        Args:
            lr: the learning rate for this step, one for all groups or ``{input name: lr}``
                (default: the schedule's, else the model's value).

        Returns:
            The apply stage's outputs (``grad_norm`` when clipping).

        Raises:
            TrainingOpError: no gradients accumulated (call :meth:`backward` first), or a bad ``lr``.
        """
        if not self._accumulation.count:
            raise TrainingOpError("optimizer_step: no gradients accumulated since the last optimizer "
                                  "step; call backward(feeds) first")
        return self._accumulation.apply(self._rates.for_step(lr), self._rates.advance)

    @locked
    def zero_grad(self) -> None:
        """Forget the accumulated gradients (torch's ``zero_grad(set_to_none=False)``)."""
        self._accumulation.zero()

    @property
    def accumulated_batches(self) -> int:
        """How many ``backward`` calls the accumulated gradients hold."""
        return self._accumulation.count

    @locked
    def gradients(self) -> dict[str, np.ndarray]:
        """A copy of each trainable's accumulated gradient (zeros before any backward). A
        sparse table's (``sparse_updates``) is dense, table-sized: the summed gradients of its
        looked-up rows, zero elsewhere (which rows count as touched is kept apart)."""
        return self._accumulation.gradients()

    @locked
    def gradient_buffers(self) -> list[np.ndarray]:
        """The live accumulated gradients as flat 1-D buffers, one per dtype: every
        ``gradients()`` entry is a view into one of them. Changing them in place (an
        all-reduce across processes) changes what :meth:`optimizer_step` applies. A sparse
        table adds two views to its dtype's buffer, after the dense gradients: its dense
        gradient, then a per-row counter of lookups (> 0: the row is updated), so a sum
        then × 1/world over processes keeps both right."""
        self._accumulation.programs()
        return list(self._accumulation.buffers)

    @locked
    def gradient_views(self) -> list[tuple[str, np.ndarray]]:
        """(trainable, live accumulator) pairs: views into :meth:`gradient_buffers`, for
        collectives that treat trainables apart (a sharded optimizer reduces each gradient to
        the rank that owns its trainable). A sparse table has two, back to back: its dense
        gradient, then its per-row touched counter (see :meth:`gradient_buffers`)."""
        return self._accumulation.views()

    @property
    def buffer_names(self) -> list[str]:
        """State the backward stage updates from the batch (BatchNorm running statistics), not
        the optimizer: per-process in data-parallel training, like torch's module buffers."""
        backward = self._accumulation.programs()[0]
        return [k for k in backward.binding if k in self._state]
