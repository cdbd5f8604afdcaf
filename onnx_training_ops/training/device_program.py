"""One graph of standard ops run over device-resident state: inputs read from it, new values fed back.

A :class:`DeviceProgram` is an onnxruntime session over a graph whose state variables are
inputs and whose ``feedback`` outputs are their new values (a training step, a backward or an
apply stage, or a graph that only reads the state: evaluation, inference). Each run binds the
state's current OrtValues as inputs (:class:`~.device_state.DeviceValues`), the batch and the
learning rates from the host, and the returned values (loss, grad norm, logits) to the host.

The new state goes either **in place**, over the old values, or into the state's **spares**,
which become the state when the step is kept. In place is chosen when it is safe: with a loss
check, the graph first routes every new value through ``Where(IsFinite(loss), new, old)``
(:func:`~onnx_training_ops.passes.guard_feedback.guard_feedback`), so a NaN loss keeps the old
state bit for bit; and no node may read a state variable after its new value is written
(:func:`~onnx_training_ops.passes.guard_feedback.in_place_unsafe`). Otherwise two sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import TrainingOpError
from ..interrupts import held_interrupts
from ..passes.guard_feedback import guard_feedback, in_place_unsafe
from ..runtime.session import InferenceSession
from ..storage.large_model import LargeModel
from ..storage.tensors import proto_of
from .device_state import DeviceValues
from .step import NonFiniteLossError


def loss_is_scalar(model: onnx.ModelProto, name: str | None) -> bool:
    """Whether ``model`` outputs ``name`` with a static shape of one element."""
    for out in model.graph.output:
        if name and out.name == name and out.type.tensor_type.HasField("shape"):
            return all(d.HasField("dim_value") and d.dim_value == 1 for d in out.type.tensor_type.shape.dim)
    return False


def plan_in_place(model: onnx.ModelProto, feedback: Mapping[str, str], loss: str | None, guard: bool,
                  wanted: bool | None, what: str) -> tuple[bool, dict[str, str]]:
    """Whether ``model`` can write its new state over the old (guarded by ``loss`` when ``guard``).

    Args:
        model: the graph; guarded in place when the answer is yes.
        feedback: state input -> the output holding its new value.
        loss: the loss output the guard reads.
        guard: a non-finite loss must keep the state (``on_nonfinite`` is not ``"ignore"``).
        wanted: True (an error when unsafe), False (two sets), None (in place when safe).
        what: names the program in errors.

    Returns:
        (in place, state input -> output holding its new value after the guard).
    """
    if wanted is False or not feedback:
        return False, dict(feedback)
    if guard and not loss_is_scalar(model, loss):  # the guard decides the whole step on one value
        if wanted:
            raise TrainingOpError(f"{what}: in_place=True needs the loss as a one-element output to guard "
                                  f"the state with (found {loss!r}); use in_place=False")
        return False, dict(feedback)
    candidate = onnx.ModelProto()
    candidate.CopyFrom(model)
    written = guard_feedback(candidate, feedback, loss) if guard else dict(feedback)
    unsafe = in_place_unsafe(candidate, written)
    if unsafe:
        if wanted:
            raise TrainingOpError(f"{what}: in_place=True, but the step model may read {unsafe[:3]}"
                                  f"{' ...' if len(unsafe) > 3 else ''} after writing its new value; "
                                  "use in_place=False")
        return False, dict(feedback)
    model.CopyFrom(candidate)
    return True, written


class DeviceProgram:
    """A graph of standard ops over :class:`~.device_state.DeviceValues`.

    Args:
        model: the graph (standard ops; state variables as inputs).
        state: the device-resident state it reads and writes.
        feedback: state input -> the output holding its new value (empty: the graph only reads).
        returned: the outputs that come back to the host, in order.
        sess_options: onnxruntime options.
        providers: the execution providers.
        loss: the loss output checked for non-finite values (None: no check).
        on_nonfinite: ``"raise"``, ``"skip"`` or ``"ignore"``.
        in_place: see :func:`plan_in_place`.
        where: names the program in errors (``"step"``, ``"backward"``...).
    """

    def __init__(self, model: onnx.ModelProto | LargeModel, state: DeviceValues, feedback: Mapping[str, str],
                 returned: Sequence[str], sess_options: ort.SessionOptions | None, providers: Sequence[Any],
                 loss: str | None = None, on_nonfinite: str = "ignore", in_place: bool | None = None,
                 where: str = "step") -> None:
        self.state, self.where, self.on_nonfinite = state, where, on_nonfinite
        self.loss = loss
        proto = proto_of(model)
        self.in_place, self.feedback = plan_in_place(proto, feedback, loss, on_nonfinite != "ignore",
                                                     in_place, where)
        if isinstance(model, LargeModel):
            model = model.with_proto(proto)
        self.session = InferenceSession(model, sess_options=sess_options, providers=providers)
        inputs = {i.name for i in self.session.get_inputs()}
        self.reads = [name for name in state if name in inputs]
        self.returned = list(returned)
        missing = [n for n in self.feedback if n not in inputs]
        if missing:
            raise TrainingOpError(f"{where}: the state variable(s) {missing} are fed back but not read")

    def run(self, feeds: Mapping[str, np.ndarray], then: Callable[[bool], None] | None = None
            ) -> tuple[dict[str, np.ndarray], bool]:
        """One run; returns the returned outputs and whether the step was skipped (non-finite loss).

        Args:
            feeds: host arrays for the graph's other inputs (batch, learning rates, scales),
                checked by the caller.
            then: ``then(skipped)``, called inside the state's write (Ctrl-C cannot split them).

        Raises:
            NonFiniteLossError: the loss was not finite and ``on_nonfinite="raise"`` (state unchanged).
            TrainingOpError: onnxruntime failed (its message, naming the program).
        """
        io = self.session.io_binding()
        values = self.state.values
        for name in self.reads:
            io.bind_ortvalue_input(name, values[name])
        for name, array in feeds.items():
            io.bind_cpu_input(name, array)  # copied up by onnxruntime
        written = [] if self.in_place else list(self.feedback)
        for name, output in self.feedback.items():
            io.bind_ortvalue_output(output, values[name] if self.in_place else self.state.spare(name))
        for name in self.returned:
            io.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(io)
        except TrainingOpError:
            raise
        except Exception as error:  # onnxruntime's own errors: name what failed
            raise TrainingOpError(f"{self.where}: onnxruntime failed on the device program: {error}") from error
        outputs = io.get_outputs()
        first = len(self.feedback)
        result = {name: outputs[first + i].numpy() for i, name in enumerate(self.returned)}
        skipped = False
        if self.loss in result and self.on_nonfinite != "ignore":
            loss = result[self.loss]
            if not np.all(np.isfinite(loss)):
                if self.on_nonfinite == "raise":
                    raise NonFiniteLossError(f"{self.where}: loss {self.loss!r} is {loss.reshape(-1)[0]}; the step "
                                             "was not applied, the state is unchanged")
                skipped = True
        with held_interrupts():  # the state and the caller's bookkeeping change together
            if not skipped:
                self.state.commit(written)
            if then is not None:
                then(skipped)
        return result, skipped


__all__ = ["DeviceProgram", "loss_is_scalar", "plan_in_place"]
