"""A session's learning rates: the rate inputs of its programs, their defaults, the schedule.

Each parameter group has one learning-rate input (R of its optimizer node). A step's rates
come from ``lr=`` if given, else from the attached schedule (:mod:`...schedules`, each input
scheduled from its own default, as torch's ``base_lrs``), else from the defaults in the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ... import schedules as lr_schedules
from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ..inputs.feeds import checked_learning_rate


class LearningRates:
    """The learning-rate inputs, their defaults, and the schedule with its position.

    Args:
        defaults: each learning-rate input -> its default array (or None).
        meta: the builder's metadata (``lr_schedule``: the schedule and its position).
    """

    def __init__(self, defaults: Mapping[str, Any], meta: TrainingMetadata) -> None:
        self.names = list(defaults)
        self.base = {name: float(value.reshape(-1)[0]) for name, value in defaults.items() if value is not None}
        self.schedule: lr_schedules.Schedule | None = None
        self.step = 0
        if meta.lr_schedule:
            self.schedule, self.step = lr_schedules.from_json(meta.lr_schedule)

    def for_step(self, lr) -> float | dict[str, float] | None:
        """This optimizer step's rates: ``lr`` if given (checked), else the schedule's, else
        None (the defaults in the model)."""
        if lr is not None:
            if not self.names:
                raise TrainingOpError(
                    "step: lr was given but no optimizer of this model takes its learning rate from a graph "
                    "input (R is a constant or computed in the graph)")
            if isinstance(lr, Mapping):
                unknown = sorted(set(lr) - set(self.names))
                if unknown:
                    raise TrainingOpError(f"step: lr names unknown learning-rate input(s) {unknown}; "
                                          f"the model's: {self.names}")
                return {name: checked_learning_rate(v, f"step: lr[{name!r}]") for name, v in lr.items()}
            return checked_learning_rate(lr)
        if self.schedule is None:
            return None
        return {name: lr_schedules.checked_rate(self.schedule, base, self.step, name)
                for name, base in self.base.items()}

    def advance(self) -> None:
        """One optimizer step taken (called inside its state write)."""
        self.step += 1

    def next(self) -> dict[str, float]:
        """The rate of each input for the next optimizer step (schedule or default)."""
        rates = self.for_step(None)
        return rates if isinstance(rates, dict) else dict(self.base)

    def attach(self, schedule, step: int = 0) -> None:
        """Drive every rate input by ``schedule`` from optimizer step ``step`` on; None detaches it."""
        if schedule is not None and type(schedule) not in lr_schedules.SCHEDULES.values():
            raise TrainingOpError(f"set_lr_schedule: expected one of "
                                  f"{sorted(lr_schedules.SCHEDULES)}, found {type(schedule).__name__}")
        if schedule is not None:
            missing = [n for n in self.names if n not in self.base]
            if not self.names or missing:
                raise TrainingOpError("set_lr_schedule: the model has no learning-rate input with a "
                                      f"default value to schedule ({missing or 'no inputs'})")
        given: object = step  # from the caller: checked, whatever its annotation says
        if isinstance(given, bool) or not isinstance(given, int) or step < 0:
            raise TrainingOpError(f"set_lr_schedule: step must be an int >= 0, found {step!r}")
        self.schedule, self.step = schedule, step

    def to_json(self) -> str:
        """The schedule and its position, for a checkpoint ("" without a schedule)."""
        return "" if self.schedule is None else lr_schedules.to_json(self.schedule, self.step)
