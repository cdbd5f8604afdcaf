"""Learning-rate schedules with ``torch.optim.lr_scheduler``'s names and semantics.

A schedule is plain data: ``schedule.lr(base_lr, k)`` is the learning rate of optimizer step
``k`` (0-based) for a parameter group whose own rate is ``base_lr`` — what torch's scheduler
gives after ``k`` calls of ``scheduler.step()``, in closed form. Attach one with
``TrainingSession.set_lr_schedule(schedule)``: the session advances it once per optimizer
step (``step`` or ``optimizer_step``), applies it to every learning-rate input (each group
from its own base rate, as torch's ``base_lrs``) and saves it, with its position, in
checkpoints.

``WarmupCosineLR`` / ``WarmupLinearLR`` are the transformers recipe
(``get_cosine_schedule_with_warmup`` / ``get_linear_schedule_with_warmup``).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from .errors import TrainingOpError


def _positive_int(cls: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TrainingOpError(f"{cls}: {name} must be an int > 0, found {value!r}")
    return value


def _warmup_steps(cls: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TrainingOpError(f"{cls}: warmup_steps must be an int >= 0, found {value!r}")


def _nonnegative(cls: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TrainingOpError(f"{cls}: {name} must be a finite number >= 0, found {value!r}")
    return float(value)


def _positive(cls: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TrainingOpError(f"{cls}: {name} must be a finite number > 0, found {value!r}")
    return float(value)


@dataclass(frozen=True)
class StepLR:
    """torch's ``StepLR``: ``base * gamma ** (k // step_size)``.

    Args:
        step_size: steps between decays (> 0).
        gamma: the decay factor (>= 0).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    step_size: int
    gamma: float = 0.1

    def __post_init__(self):
        _positive_int("StepLR", "step_size", self.step_size)
        _nonnegative("StepLR", "gamma", self.gamma)

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        return base * self.gamma ** (k // self.step_size)


@dataclass(frozen=True)
class MultiStepLR:
    """torch's ``MultiStepLR``: ``base * gamma ** (number of milestones <= k)``.

    Args:
        milestones: the steps at which the rate decays (each > 0; sorted here).
        gamma: the decay factor (>= 0).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    milestones: tuple[int, ...]
    gamma: float = 0.1

    def __post_init__(self):
        milestones = tuple(self.milestones)
        for m in milestones:
            _positive_int("MultiStepLR", "milestones", m)
        object.__setattr__(self, "milestones", tuple(sorted(milestones)))
        _nonnegative("MultiStepLR", "gamma", self.gamma)

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        return base * self.gamma ** bisect.bisect_right(self.milestones, k)


@dataclass(frozen=True)
class ExponentialLR:
    """torch's ``ExponentialLR``: ``base * gamma ** k``.

    Args:
        gamma: the decay factor per step (>= 0).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    gamma: float

    def __post_init__(self):
        _nonnegative("ExponentialLR", "gamma", self.gamma)

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        return base * self.gamma ** k


@dataclass(frozen=True)
class CosineAnnealingLR:
    """torch's ``CosineAnnealingLR``: ``eta_min + (base - eta_min) * (1 + cos(pi * k / T_max)) / 2``.

    Periodic past ``T_max``, as torch's.

    Args:
        T_max: steps of one half cosine period (> 0).
        eta_min: the lowest rate (>= 0).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    T_max: int
    eta_min: float = 0.0

    def __post_init__(self):
        _positive_int("CosineAnnealingLR", "T_max", self.T_max)
        _nonnegative("CosineAnnealingLR", "eta_min", self.eta_min)

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * k / self.T_max)) / 2


@dataclass(frozen=True)
class LinearLR:
    """torch's ``LinearLR``: ``base * factor``, the factor going linearly over ``total_iters`` steps.

    Args:
        start_factor: the factor at step 0, in (0, 1].
        end_factor: the factor from step ``total_iters`` on, in [0, 1].
        total_iters: steps of the linear change (> 0).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    start_factor: float = 1.0 / 3
    end_factor: float = 1.0
    total_iters: int = 5

    def __post_init__(self):
        if not 0 < self.start_factor <= 1 or not 0 <= self.end_factor <= 1:
            raise TrainingOpError(f"LinearLR: start_factor must be in (0, 1] and end_factor in [0, 1], "
                                  f"found {self.start_factor!r}, {self.end_factor!r}")
        _positive_int("LinearLR", "total_iters", self.total_iters)

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        t = min(k, self.total_iters) / self.total_iters
        return base * (self.start_factor + (self.end_factor - self.start_factor) * t)


@dataclass(frozen=True)
class OneCycleLR:
    """torch's ``OneCycleLR`` with ``cycle_momentum=False``.

    The rates come from ``max_lr``, not the base rate. Momentum cycling is not offered: the
    momentum is an attribute of the optimizer node.

    Args:
        max_lr: the peak rate, a number or ``{learning-rate input: max_lr}`` per group.
        total_steps: steps of the whole cycle (> 0); a step past it raises.
        pct_start: the fraction of the cycle spent rising, in [0, 1].
        anneal_strategy: ``"cos"`` or ``"linear"``.
        div_factor: the initial rate is ``max_lr / div_factor``.
        final_div_factor: the final rate is the initial one ``/ final_div_factor``.
        three_phase: torch's third phase (back down to the initial rate before the final decay).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    max_lr: float | Mapping[str, float]
    total_steps: int
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False

    def __post_init__(self):
        _positive_int("OneCycleLR", "total_steps", self.total_steps)
        if self.anneal_strategy not in ("cos", "linear"):
            raise TrainingOpError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', found "
                                  f"{self.anneal_strategy!r}")
        pct_start: object = self.pct_start  # from the caller: checked, whatever its annotation says
        if isinstance(pct_start, bool) or not isinstance(pct_start, (int, float)) or not 0 <= pct_start <= 1:
            raise TrainingOpError(f"OneCycleLR: pct_start must be in [0, 1], found {self.pct_start!r}")
        if self.three_phase and self.pct_start > 0.5:
            raise TrainingOpError(f"OneCycleLR: three_phase with pct_start={self.pct_start!r}: the warm-up and the "
                                  "equal-length way back would take more than total_steps; pass pct_start <= 0.5")
        _positive("OneCycleLR", "div_factor", self.div_factor)
        _positive("OneCycleLR", "final_div_factor", self.final_div_factor)
        if isinstance(self.max_lr, Mapping):
            object.__setattr__(self, "max_lr", dict(self.max_lr))
            for name, value in self.max_lr.items():
                _nonnegative("OneCycleLR", f"max_lr[{name!r}]", value)
        else:
            _nonnegative("OneCycleLR", "max_lr", self.max_lr)

    def max_lr_of(self, name: str) -> float:
        if isinstance(self.max_lr, Mapping):
            if name not in self.max_lr:
                raise TrainingOpError(f"OneCycleLR: max_lr has no entry for learning rate {name!r}")
            return float(self.max_lr[name])
        return float(self.max_lr)

    def lr(self, base: float, k: int, name: str = "") -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the input ``name``.

        Args:
            base: the learning-rate input's own value (unused: the rates come from ``max_lr``).
            k: optimizer steps taken before this one.
            name: the learning-rate input, for a per-group ``max_lr``.

        Returns:
            The rate.

        Raises:
            TrainingOpError: ``k`` past ``total_steps``, or no ``max_lr`` entry for ``name``.
        """
        top = self.max_lr_of(name)
        initial = top / self.div_factor
        low = initial / self.final_div_factor
        end = float(self.pct_start * self.total_steps) - 1
        if self.three_phase:
            phases = [(end, initial, top), (float(2 * self.pct_start * self.total_steps) - 2, top, initial),
                      (self.total_steps - 1, initial, low)]
        else:
            phases = [(end, initial, top), (self.total_steps - 1, top, low)]
        if k > self.total_steps:
            raise TrainingOpError(f"OneCycleLR: step {k + 1} is beyond total_steps={self.total_steps}")
        start = 0.0
        for i, (phase_end, a, b) in enumerate(phases):
            if k <= phase_end or i == len(phases) - 1:
                pct = (k - start) / (phase_end - start)
                if self.anneal_strategy == "cos":
                    return b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1)
                return (b - a) * pct + a
            start = phase_end
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class WarmupCosineLR:
    """transformers' ``get_cosine_schedule_with_warmup``.

    Linear warm-up from 0 over ``warmup_steps``, then cosine decay to 0 at ``total_steps``.

    Args:
        warmup_steps: steps of the warm-up (>= 0, at most ``total_steps``).
        total_steps: the step at which the rate reaches 0 (> 0).
        num_cycles: cosine cycles over the decay (0.5: one half cosine down to 0).

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    warmup_steps: int
    total_steps: int
    num_cycles: float = 0.5

    def __post_init__(self):
        _positive_int("WarmupCosineLR", "total_steps", self.total_steps)
        _nonnegative("WarmupCosineLR", "num_cycles", self.num_cycles)
        _warmup_steps("WarmupCosineLR", self.warmup_steps)
        if self.warmup_steps > self.total_steps:
            raise TrainingOpError(f"WarmupCosineLR: warmup_steps={self.warmup_steps} is more than total_steps="
                                  f"{self.total_steps}: the warm-up would never end (the rate would rise past "
                                  "the base and the decay never start); pass warmup_steps <= total_steps")

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        if k < self.warmup_steps:
            return base * k / max(1, self.warmup_steps)
        progress = (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.num_cycles * 2.0 * progress)))


@dataclass(frozen=True)
class WarmupLinearLR:
    """transformers' ``get_linear_schedule_with_warmup``.

    Linear warm-up from 0 over ``warmup_steps``, then linear decay to 0 at ``total_steps``.

    Args:
        warmup_steps: steps of the warm-up (>= 0, at most ``total_steps``).
        total_steps: the step at which the rate reaches 0 (> 0).
        allow_warmup_past_total: accept ``warmup_steps > total_steps``: onnxruntime-training
            1.19.2's ``LinearLRScheduler`` (its binding swaps the two counts), a rise over
            ``warmup_steps`` and 0 from ``warmup_steps`` on.

    Raises:
        TrainingOpError: a value out of range (named, with what was found).
    """

    warmup_steps: int
    total_steps: int
    allow_warmup_past_total: bool = False

    def __post_init__(self):
        _positive_int("WarmupLinearLR", "total_steps", self.total_steps)
        _warmup_steps("WarmupLinearLR", self.warmup_steps)
        if self.warmup_steps > self.total_steps and not self.allow_warmup_past_total:
            raise TrainingOpError(f"WarmupLinearLR: warmup_steps={self.warmup_steps} is more than total_steps="
                                  f"{self.total_steps}: the rate would drop to 0 before the warm-up ends; pass "
                                  "warmup_steps <= total_steps (allow_warmup_past_total=True reproduces "
                                  "onnxruntime-training 1.19.2's LinearLRScheduler, whose binding swaps the two)")

    def lr(self, base: float, k: int) -> float:
        """The learning rate of optimizer step ``k`` (0-based) for the base rate ``base``.

        Args:
            base: the learning-rate input's own value (torch's ``base_lrs``).
            k: optimizer steps taken before this one.

        Returns:
            The rate.
        """
        if k < self.warmup_steps:
            return base * k / max(1, self.warmup_steps)
        return base * max(0.0, (self.total_steps - k) / max(1, self.total_steps - self.warmup_steps))


Schedule = (StepLR | MultiStepLR | ExponentialLR | CosineAnnealingLR | LinearLR | OneCycleLR
            | WarmupCosineLR | WarmupLinearLR)
SCHEDULES = {cls.__name__: cls for cls in (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR,
                                           LinearLR, OneCycleLR, WarmupCosineLR, WarmupLinearLR)}


def rate(schedule: Schedule, base: float, k: int, name: str) -> float:
    """The learning rate of input ``name`` (base rate ``base``) at optimizer step ``k``, as
    the schedule's formula gives it (a TrainingOpError when the formula cannot be computed:
    a phase of length 0). :func:`checked_rate` is what a step uses."""
    try:
        return schedule.lr(base, k, name) if isinstance(schedule, OneCycleLR) else schedule.lr(base, k)
    except ArithmeticError as error:  # a zero-length phase, an overflow
        raise TrainingOpError(f"{type(schedule).__name__}: the learning rate of {name!r} at optimizer step {k} "
                              f"is not computable ({error}); the step was not taken") from None


def checked_rate(schedule: Schedule, base: float, k: int, name: str) -> float:
    """:func:`rate`, checked as ``step(lr=...)`` checks a rate: a finite number >= 0, or a
    TrainingOpError before the step (the arguments are checked at construction; this
    catches what they combine into, e.g. a linear OneCycleLR read past its last step)."""
    value = rate(schedule, base, k, name)
    if not math.isfinite(value) or value < 0:
        raise TrainingOpError(f"{type(schedule).__name__}: the learning rate of {name!r} at optimizer step {k} "
                              f"is {value!r}; a rate must be a finite number >= 0 (the step was not taken)")
    return float(value)


def to_json(schedule: Schedule, k: int) -> str:
    """The schedule and its position (optimizer steps taken), for a checkpoint."""
    args = asdict(schedule)
    if args.get("allow_warmup_past_total") is False:  # the default: written only when set
        del args["allow_warmup_past_total"]
    return json.dumps({"type": type(schedule).__name__, "step": k, "args": args})


def from_json(text: str) -> tuple[Schedule, int]:
    try:
        data = json.loads(text)
        cls = SCHEDULES[data["type"]]
        args = data["args"]
        if "milestones" in args:
            args["milestones"] = tuple(args["milestones"])
        return cls(**args), int(data["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise TrainingOpError(f"the checkpoint's learning-rate schedule cannot be read: {error}") from None
