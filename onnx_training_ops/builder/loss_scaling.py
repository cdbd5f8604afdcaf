"""Dynamic loss scaling in the algorithm graph, with ``torch.amp.GradScaler``'s semantics.

Three state variables, updated in the graph and fed back like the optimizer state (so the
same step runs in a :class:`~onnx_training_ops.TrainingSession`, in an exported step and in
``DeviceTrainer``): ``loss_scale`` (float32, starts at ``init_scale``),
``loss_scale.growth_tracker`` (int64, clean steps since the last change) and
``loss_scale.skipped_steps`` (int64, steps skipped for a non-finite gradient). Each step:

1. the Gradient differentiates ``loss * loss_scale`` (the returned loss is the unscaled one);
2. the gradients are multiplied by ``1 / loss_scale`` before clipping (torch's
   ``scaler.unscale_`` then ``clip_grad_norm_``);
3. ``finite`` = every gradient element is finite (``ReduceSum(g * 0) == 0``, on the scaled
   values as torch checks them);
4. every parameter, optimizer state and T takes its new value only where ``finite``
   (``Where``): a skipped step leaves them bit-identical and T not advanced;
5. the scale: not finite -> ``scale * backoff_factor``, tracker 0, skipped + 1; finite ->
   tracker + 1, and when it reaches ``growth_interval`` the scale grows by ``growth_factor``
   (if that stays finite) and the tracker restarts at 0 (``torch._amp_update_scale_``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingOpError
from ..passes._graph import unique_name
from .algorithm import Algorithm, tensor_vi


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling's settings, torch ``GradScaler``'s names and defaults.

    Args:
        init_scale: the first scale.
        growth_factor: the scale's factor after ``growth_interval`` clean steps in a row.
        backoff_factor: the scale's factor after a step with a non-finite gradient.
        growth_interval: clean steps between two growths.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value <= 0 or value > float(np.finfo(np.float32).max):
                raise TrainingOpError(f"LossScaling.{name} must be a number > 0, finite in float32, found {value!r}")
        if self.growth_factor <= 1.0:
            raise TrainingOpError(f"LossScaling.growth_factor must be > 1, found {self.growth_factor!r}")
        if self.backoff_factor >= 1.0:
            raise TrainingOpError(f"LossScaling.backoff_factor must be < 1, found {self.backoff_factor!r}")
        interval: object = self.growth_interval  # from the caller: checked, whatever its annotation says
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise TrainingOpError(f"LossScaling.growth_interval must be an int >= 1, found {self.growth_interval!r}")


def checked_scaling(loss_scaling, precision: str) -> LossScaling | None:
    """The loss scaling a build uses: ``None`` -> torch's default for the precision (fp16:
    :class:`LossScaling`(), else none); ``False`` -> none; a :class:`LossScaling` as given."""
    if loss_scaling is None:
        return LossScaling() if precision == "fp16" else None
    if loss_scaling is False:
        return None
    if loss_scaling is True:
        return LossScaling()
    if not isinstance(loss_scaling, LossScaling):
        raise TrainingOpError(f"loss_scaling must be a LossScaling, True, False or None, found "
                              f"{type(loss_scaling).__name__}")
    return loss_scaling


class LossScaler:
    """Writes the loss scaling's nodes and state into the algorithm graph (see the module doc)."""

    def __init__(self, config: LossScaling, algo: Algorithm) -> None:
        self.config, self.algo = config, algo
        self.scale = algo.name("loss_scale")
        self.growth = algo.name("loss_scale.growth_tracker")
        self.skipped = algo.name("loss_scale.skipped_steps")
        self.finite = algo.name("loss_scale.finite")
        algo.inits += [numpy_helper.from_array(np.array(config.init_scale, np.float32), self.scale),
                       numpy_helper.from_array(np.array(0, np.int64), self.growth),
                       numpy_helper.from_array(np.array(0, np.int64), self.skipped)]
        self.zero = self._const("zero", 0.0, np.float32)

    def _const(self, base: str, value, dtype) -> str:
        name = self.algo.name(f"loss_scale.{base}")
        self.algo.inits.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def _node(self, op: str, inputs: list[str], base: str, **attrs) -> str:
        out = self.algo.name(f"loss_scale/{base}")
        self.algo.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def scaled_loss(self, loss: str) -> str:
        """``loss * loss_scale`` (a float32 loss): what the Gradient differentiates."""
        return self._node("Mul", [loss, self.scale], "scaled_loss")

    def unscale(self, grads: list[str], dtypes: list[int]) -> list[str]:
        """The gradients times ``1 / loss_scale``; sets ``finite``: every element of the scaled
        gradients is finite (torch's ``_amp_foreach_non_finite_check_and_unscale_`` checks the
        value before it unscales it)."""
        inv = self._node("Reciprocal", [self.scale], "inv_scale")
        zero = self.zero
        out, checks = [], []
        for g, dtype in zip(grads, dtypes):
            factor, z = inv, zero
            if dtype != TensorProto.FLOAT:
                factor = self._node("Cast", [inv], "inv_scale_cast", to=dtype)
                z = self._node("Cast", [zero], "zero_cast", to=dtype)
            u = self._node("Mul", [g, factor], f"unscaled_{g}")
            zeroed = self._node("Mul", [g, z], f"zeroed_{g}")  # the scaled value, as torch checks it
            s = self._node("ReduceSum", [zeroed], f"check_{g}", keepdims=0)
            if dtype != TensorProto.FLOAT:
                s = self._node("Cast", [s], f"check_cast_{g}", to=TensorProto.FLOAT)
            checks.append(s)
            out.append(u)
        total = checks[0]
        for c in checks[1:]:
            total = self._node("Add", [total, c], "check_sum")
        self.algo.nodes.append(helper.make_node("Equal", [total, zero], [self.finite], name=self.finite))
        return out

    def gated(self, state: str, new: str) -> str:
        """``new`` where the gradients were finite, else ``state`` (the skipped step)."""
        return self._node("Where", [self.finite, new, state], f"keep_{state}")

    def finish(self) -> None:
        """The scale's own update, bound to its state (GradScaler.update)."""
        c = self.config
        one = self._const("one", 1, np.int64)
        zero_i = self._const("zero_i", 0, np.int64)
        interval = self._const("growth_interval", c.growth_interval, np.int64)
        growth_f = self._const("growth_factor", c.growth_factor, np.float32)
        backoff_f = self._const("backoff_factor", c.backoff_factor, np.float32)
        zero = self.zero
        tracked = self._node("Add", [self.growth, one], "tracked")
        due = self._node("GreaterOrEqual", [tracked, interval], "due")
        grown = self._node("Mul", [self.scale, growth_f], "grown")
        grown_ok = self._node("Equal", [self._node("Mul", [grown, zero], "grown_zeroed"), zero], "grown_finite")
        grow = self._node("And", [due, grown_ok], "grow")
        on_finite = self._node("Where", [grow, grown, self.scale], "scale_if_finite")
        backed = self._node("Mul", [self.scale, backoff_f], "backed_off")
        new_scale = self._node("Where", [self.finite, on_finite, backed], "scale_new")
        tracker_if_finite = self._node("Where", [due, zero_i, tracked], "tracker_if_finite")
        new_growth = self._node("Where", [self.finite, tracker_if_finite, zero_i], "growth_new")
        missed = self._node("Cast", [self._node("Not", [self.finite], "not_finite")], "missed",
                            to=TensorProto.INT64)
        new_skipped = self._node("Add", [self.skipped, missed], "skipped_new")
        self.algo.bind(self.scale, new_scale, TensorProto.FLOAT, [])
        self.algo.bind(self.growth, new_growth, TensorProto.INT64, [])
        self.algo.bind(self.skipped, new_skipped, TensorProto.INT64, [])

    def initialization(self, graph: onnx.GraphProto, binding: list[tuple[str, str]], taken: set[str]) -> None:
        """The state's initial values in the initialization graph (in place) and its binding."""
        for state, value, dtype, elem in ((self.scale, self.config.init_scale, np.float32, TensorProto.FLOAT),
                                          (self.growth, 0, np.int64, TensorProto.INT64),
                                          (self.skipped, 0, np.int64, TensorProto.INT64)):
            out = unique_name(taken, f"{state}.init")
            graph.node.append(helper.make_node("Constant", [], [out], name=unique_name(taken, f"init/{state}"),
                                               value=numpy_helper.from_array(np.array(value, dtype))))
            graph.output.append(tensor_vi(out, elem, []))
            binding.append((state, out))

    def metadata(self) -> dict[str, Any]:
        """The builder's record (``loss_scaling``): the settings and the state's names."""
        return {**asdict(self.config), "scale": self.scale, "growth_tracker": self.growth,
                "skipped_steps": self.skipped}
