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


def _static(vi: onnx.ValueInfoProto) -> list[int] | None:
    """The dims of a value declared with a fully static shape, else None."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
        return None
    return [d.dim_value for d in tt.shape.dim]


def fixed_address_plan(model: onnx.ModelProto, state: DeviceValues, returned: Sequence[str], in_place: bool
                       ) -> str | None:
    """Why ``model`` cannot run with every input and output at a fixed device address (None: it can).

    That needs the state written in place (two sets swap addresses), every other input and every
    returned output of a static shape, and no input with a stored default (a fixed buffer would
    keep the last value fed instead of going back to the default)."""
    if not in_place:
        return "the state is written into a second set (in place is unsafe or off)"
    graph = model.graph
    defaults = {t.name for t in graph.initializer}
    for vi in graph.input:
        if vi.name in state:
            continue
        if vi.name in defaults:
            return f"input {vi.name!r} has a stored default"
        if _static(vi) is None:
            return f"input {vi.name!r} has no static shape (pass input_shapes)"
    outputs = {o.name: o for o in graph.output}
    for name in returned:
        if name not in outputs or _static(outputs[name]) is None:
            return f"output {name!r} has no static shape"
        if outputs[name].type.tensor_type.elem_type not in _FIXED_TYPES:
            return f"output {name!r} is of a type the fixed buffers do not hold"
    return None


def with_graph_capture(providers: Sequence[Any]) -> list:
    """``providers`` with CUDA graphs enabled on the CUDA provider (``enable_cuda_graph``)."""
    out: list = []
    for provider in providers:
        name, options = (provider if isinstance(provider, tuple) else (provider, {}))
        if name == "CUDAExecutionProvider":
            provider = (name, {**dict(options), "enable_cuda_graph": "1"})
        out.append(provider)
    return out


class DeviceProgram:
    """A graph of standard ops over :class:`~.device_state.DeviceValues`.

    Args:
        model: the graph (standard ops; state variables as inputs); guarded in place when
            its new state goes in place.
        state: the device-resident state it reads and writes.
        feedback: state input -> the output holding its new value (empty: the graph only reads).
        returned: the outputs that come back to the host, in order.
        sess_options: onnxruntime options.
        providers: the execution providers.
        loss: the loss output checked for non-finite values (None: no check).
        on_nonfinite: ``"raise"``, ``"skip"`` or ``"ignore"``.
        in_place: see :func:`plan_in_place`.
        where: names the program in errors (``"step"``, ``"backward"``...).
        fixed: bind every input and output once, to buffers at fixed device addresses (the
            batch copied into them each run) when :func:`fixed_address_plan` allows it; on a
            CUDA device this turns CUDA graphs on (``enable_cuda_graph``): the first runs capture
            the step's kernels and later ones replay them, with no launch per kernel.
    """

    def __init__(self, model: LargeModel, state: DeviceValues, feedback: Mapping[str, str],
                 returned: Sequence[str], sess_options: ort.SessionOptions | None, providers: Sequence[Any],
                 loss: str | None = None, on_nonfinite: str = "ignore", in_place: bool | None = None,
                 where: str = "step", fixed: bool = False) -> None:
        self.state, self.where, self.on_nonfinite = state, where, on_nonfinite
        self.loss = loss
        proto = model.model_proto  # guarded in place when written in place
        self.in_place, self.feedback = plan_in_place(proto, feedback, loss, on_nonfinite != "ignore",
                                                     in_place, where)
        self.returned = list(returned)
        # why the inputs and outputs are not at fixed addresses (None: they are)
        self.not_fixed: str | None = fixed_address_plan(proto, state, self.returned, self.in_place) if fixed \
            else "not asked for"
        self.graph_capture = self.not_fixed is None and state.device == "cuda"
        self.session = self._open(model, sess_options, providers)
        inputs = {i.name for i in self.session.get_inputs()}
        self.reads = [name for name in state if name in inputs]
        missing = [n for n in self.feedback if n not in inputs]
        if missing:
            raise TrainingOpError(f"{where}: the state variable(s) {missing} are fed back but not read")
        self._io: Any = None  # the one binding of a fixed-address program (made on its first run)
        self._bound: dict[tuple, Any] = {}  # the state's buffers (ids) -> a binding to them
        self._fixed_inputs: dict[str, ort.OrtValue] = {}
        self._fixed_outputs: list[ort.OrtValue] = []

    def _open(self, model: Any, sess_options: ort.SessionOptions | None, providers: Sequence[Any]) -> Any:
        """The onnxruntime session; with CUDA graphs when planned, else (onnxruntime refuses to
        capture a graph with a node off the CUDA EP) without them, the reason kept."""
        if self.graph_capture:
            try:
                return InferenceSession(model, sess_options=sess_options, providers=with_graph_capture(providers))
            except Exception as error:  # noqa: BLE001 - the reason is reported by graph_capture_refused
                self.graph_capture = False
                self.not_fixed = f"onnxruntime refused CUDA graphs: {str(error).splitlines()[0]}"
        return InferenceSession(model, sess_options=sess_options, providers=providers)

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
        written = [] if self.in_place else list(self.feedback)
        if self.not_fixed is None:
            io, outputs = self._fixed_binding(feeds), self._fixed_outputs
        else:
            io, outputs = self._binding(feeds), None
        try:
            self.session.run_with_iobinding(io)
        except TrainingOpError:
            raise
        except Exception as error:  # onnxruntime's own errors: name what failed
            raise TrainingOpError(f"{self.where}: onnxruntime failed on the device program: {error}") from error
        if outputs is None:
            outputs = io.get_outputs()[len(self.feedback):]
        result = {name: _host(value) for name, value in zip(self.returned, outputs)}
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

    def _binding(self, feeds: Mapping[str, np.ndarray]) -> Any:
        """A binding for this run: the state's current values, the feeds from the host. The
        state's part is bound again only when its buffers changed (a two-set swap, here or in
        another program over the same state): hundreds of binds a step otherwise."""
        values = self.state.values
        reads = [values[name] for name in self.reads]
        writes = [values[name] if self.in_place else self.state.spare(name) for name in self.feedback]
        # the feeds' names too: a binding never keeps a value an earlier run fed that this one does not
        key = tuple(map(id, reads)) + tuple(map(id, writes)) + tuple(feeds)
        cached = self._bound.get(key)
        if cached is None:
            cached = self.session.io_binding()
            for name, value in zip(self.reads, reads):
                cached.bind_ortvalue_input(name, value)
            for output, value in zip(self.feedback.values(), writes):
                cached.bind_ortvalue_output(output, value)
            if len(self._bound) >= 2:  # two sets: two bindings in turn
                self._bound.pop(next(iter(self._bound)))
            self._bound[key] = cached
        for name, array in feeds.items():
            cached.bind_cpu_input(name, array)  # copied up by onnxruntime
        for name in self.returned:  # allocated by onnxruntime each run (a shape may change)
            cached.bind_output(name, "cpu")
        return cached

    def _fixed_binding(self, feeds: Mapping[str, np.ndarray]) -> Any:
        """The one binding, made on the first run (every input and output in a device buffer of
        its own); each run copies the feeds into their buffers."""
        if self._io is None:
            state, device, index = self.state, self.state.device, self.state.device_id
            io = self.session.io_binding()
            for name in self.reads:
                io.bind_ortvalue_input(name, state.values[name])
            for name, output in self.feedback.items():
                io.bind_ortvalue_output(output, state.values[name])
            declared = {i.name: i for i in self.session.get_inputs()}
            for name in declared:
                if name in state.values:
                    continue
                if name not in feeds:
                    raise TrainingOpError(f"{self.where}: input {name!r} is missing")
                value = ort.OrtValue.ortvalue_from_numpy(np.array(feeds[name], order="C"), device, index)
                self._fixed_inputs[name] = value
                io.bind_ortvalue_input(name, value)
            shapes = {o.name: (o.shape, o.type) for o in self.session.get_outputs()}
            for name in self.returned:
                shape, text = shapes[name]
                value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), _ONNX_TYPES[text], device, index)
                self._fixed_outputs.append(value)
                io.bind_ortvalue_output(name, value)
            self._io = io
            return io
        for name, value in self._fixed_inputs.items():
            if name not in feeds:
                raise TrainingOpError(f"{self.where}: input {name!r} is missing")
            array = feeds[name]
            value.update_inplace(array if isinstance(array, np.ndarray) and array.flags.c_contiguous
                                 else np.array(array, order="C"))  # no host copy of a batch that needs none
        return self._io


# the returned outputs' element types a fixed buffer is made for (TensorProto enum)
_FIXED_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64,
                onnx.TensorProto.INT32, onnx.TensorProto.BOOL}
# onnxruntime's NodeArg type text -> numpy dtype (the returned outputs' buffers)
_ONNX_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def _host(value: ort.OrtValue) -> np.ndarray:
    """A host array the caller owns (a CPU OrtValue's ``numpy()`` is a view of its buffer)."""
    host = value.numpy()
    return host.copy() if value.device_name().lower() == "cpu" else host


__all__ = ["DeviceProgram", "fixed_address_plan", "loss_is_scalar", "plan_in_place", "with_graph_capture"]
