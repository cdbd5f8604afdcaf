"""The in-graph update strategy: every program one graph of standard ops over the state's memory.

The graphs are the ones :func:`~onnx_training_ops.export.export_step` writes, made in memory:
each program's main graph + algorithm (:func:`~..graphs.program.combined_graph`, the state as inputs)
:func:`~onnx_training_ops.prepare`-d with ``portable=True, flat=True`` (Gradient expanded, each
optimizer lowered to a few standard elementwise ops over its tensors laid end to end), so every
node has a kernel on the device's execution provider and nothing runs in Python between the
batch going up and the loss coming down. :class:`GraphProgram` runs one over a
:class:`~.memory.StateMemory`: its state variables are inputs and its ``feedback`` outputs
their new values (a step, a backward or an apply stage), or it only reads them (evaluation,
inference).

**In place or two sets.** The new state goes over the old values when that is safe: with a
loss check, the graph first routes every new value through ``Where(IsFinite(loss), new, old)``
(:func:`~onnx_training_ops.passes.guard_feedback.guard_feedback`), so a NaN loss keeps the old
state bit for bit; and no node may read a state variable after its new value is written
(:func:`~onnx_training_ops.passes.guard_feedback.in_place_unsafe`). Otherwise into the
memory's spares, which become the state when the step is kept.

**Fixed addresses and CUDA graphs.** A step with static inputs (their own or ``input_shapes``)
written in place binds every input and output once, to buffers at fixed addresses (each batch
copied into them); on a CUDA device that turns CUDA graphs on. onnxruntime's first ``Run`` of
such a session runs the model again until the graph is captured, then replays it: 2-3 runs for
one call. So the guard also reads a bool input, ``onnx_training_ops.apply``, ANDed into the
``Where``: the first call runs with it False (a warm-up that writes nothing: the state keeps
its values however many times onnxruntime runs the graph), and every later call with it True,
read from its fixed buffer by the captured graph.

**Ctrl-C.** A run that writes the state in place holds Ctrl-C from its start to the end of the
caller's bookkeeping (``then``): state, counters and schedule move together. A two-set run
writes only spares, so a Ctrl-C during it cancels the step; its commit and bookkeeping are held.

**Frozen tensors** (a LoRA base model): inputs of the graph, bound to one copy in the memory
that every program of the session shares, not initializers copied into each onnxruntime session.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...interrupts import held_interrupts
from ...passes.guard_feedback import guard_feedback, in_place_unsafe
from ...passes.order_writes import writes_after_reads
from ...runtime.kernel_table import CUDA, Placement, cpu_nodes
from ...runtime.kernel_table import PROVIDERS as KERNEL_PROVIDERS
from ...runtime.pipeline import prepare_model
from ...runtime.session import InferenceSession
from ...storage.large_model import LargeModel
from ...storage.tensors import tensor_value
from ...walk import drop_named
from ..graphs.binding import detached_as_inputs
from ..graphs.program import combined_graph, learning_rate_inputs
from ..graphs.stages import Stages
from ..graphs.static_shapes import static_graph
from ..graphs.step import NonFiniteLossError
from ..inputs.feeds import FeedSpec, checked_learning_rate, feed_array, feed_spec
from ..options.providers import CPU, device_providers, provider_name
from ..state.flat_parameters import lay_out_flat
from .memory import HostMemory, StateMemory

APPLY = "onnx_training_ops.apply"  # the bool input that lets a fixed-address step write its state


def loss_is_scalar(model: onnx.ModelProto, name: str | None) -> bool:
    """Whether ``model`` outputs ``name`` with a static shape of one element."""
    for out in model.graph.output:
        if name and out.name == name and out.type.tensor_type.HasField("shape"):
            return all(d.HasField("dim_value") and d.dim_value == 1 for d in out.type.tensor_type.shape.dim)
    return False


def plan_in_place(model: onnx.ModelProto, feedback: Mapping[str, str], loss: str | None, guard: bool,
                  wanted: bool | None, what: str, gate: str | None = None) -> tuple[bool, dict[str, str]]:
    """Whether ``model`` can write its new state over the old (guarded by ``loss`` when ``guard``).

    Args:
        model: the graph; guarded in place when the answer is yes.
        feedback: state input -> the output holding its new value.
        loss: the loss output the guard reads.
        guard: a non-finite loss must keep the state (``on_nonfinite`` is not ``"ignore"``).
        wanted: True (an error when unsafe), False (two sets), None (in place when safe).
        what: names the program in errors.
        gate: a bool input ANDed into the guard (added to the graph when it goes in place).

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
    written = guard_feedback(candidate, feedback, loss if guard else None, gate) if guard or gate \
        else dict(feedback)
    unsafe = in_place_unsafe(candidate, written)
    if unsafe and writes_after_reads(candidate, written, unsafe):  # the guard waits for every read
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


def static_inputs_plan(model: onnx.ModelProto, memory: Container[str], returned: Sequence[str]) -> str | None:
    """Why ``model``'s inputs and returned outputs cannot sit at fixed addresses (None: they can):
    every input that is no state must have a static shape and no stored default (a fixed buffer
    would keep the last value fed instead of going back to the default), every returned output a
    static shape and a type the fixed buffers hold."""
    graph = model.graph
    defaults = {t.name for t in graph.initializer}
    for vi in graph.input:
        if vi.name in memory:
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


def captures(device: str) -> bool:
    """Whether a fixed-address program over state on ``device`` replays a CUDA graph."""
    return device == "cuda"


def device_provider(device: str) -> str:
    """The execution provider whose kernels run a graph over state on ``device``: the graphs
    are built for it (its pass pipeline) and checked against its kernel table."""
    return provider_name(device_providers(device)[0]) if device != "cpu" else CPU


def off_device_text(nodes: Sequence[Placement], provider: str, limit: int = 6) -> str:
    """``nodes`` (that ``provider`` has no kernel for) in one sentence."""
    listed = "; ".join(str(p) for p in nodes[:limit]) + (f"; ... {len(nodes) - limit} more" if len(nodes) > limit
                                                           else "")
    return f"{len(nodes)} node(s) have no {provider} kernel at their types and run on the CPU: {listed}"


def with_graph_capture(providers: Sequence[Any]) -> list:
    """``providers`` with CUDA graphs enabled on the CUDA provider (``enable_cuda_graph``)."""
    out: list = []
    for provider in providers:
        name, options = (provider if isinstance(provider, tuple) else (provider, {}))
        if name == "CUDAExecutionProvider":
            provider = (name, {**dict(options), "enable_cuda_graph": "1"})
        out.append(provider)
    return out


@dataclass(frozen=True)
class Feeds:
    """What a graph program takes from the host: required and optional inputs, the learning
    rates' defaults and the other optional inputs' defaults."""

    required: list[FeedSpec]
    optional: list[FeedSpec]
    rate_defaults: Mapping[str, np.ndarray | None]
    input_defaults: Mapping[str, np.ndarray]

    def host(self, feeds: Mapping[str, Any], rates: float | Mapping[str, float] | None,
             where: str) -> dict[str, np.ndarray]:
        """Every input's value for a run: the batch (checked against the graph's inputs), an
        optional input's default when it is not fed, the learning rates."""
        specs = {s.name: s for s in (*self.required, *self.optional)}
        arrays = {name: feed_array(specs[name], value, where) for name, value in feeds.items()
                  if name in specs and name not in self.rate_defaults}
        for name, default in self.input_defaults.items():
            arrays.setdefault(name, default)
        for name, rate_default in self.rate_defaults.items():
            spec = specs[name]
            value: float | None = rates.get(name) if isinstance(rates, Mapping) else rates
            if value is None and name in feeds:
                value = checked_learning_rate(np.asarray(feeds[name]).reshape(-1)[0], f"{where}: feed {name!r}")
            if value is not None:
                arrays[name] = np.full(spec.shape or (), value, spec.dtype)
            elif rate_default is not None:
                arrays[name] = rate_default
            else:
                raise TrainingOpError(f"{where}: learning rate {name!r} has no default: pass lr=")
        return arrays


@dataclass(frozen=True)
class StateNames:
    """What planning a graph program reads of a :class:`~.memory.StateMemory`: which names are
    state, and the device it lives on. Stands in for a memory where none is open
    (:func:`~.device_graphs.device_step_graphs`)."""

    names: frozenset[str]
    device: str = "cpu"
    device_id: int = 0

    def __contains__(self, name: object) -> bool:
        return name in self.names


@dataclass
class ProgramPlan:
    """A graph program as planned, before onnxruntime opens it: the graph it opens (frozen
    tensors as inputs) and every decision made about it. :func:`plan_program` makes it, on any
    machine; :class:`GraphProgram` opens it."""

    model: LargeModel  # what onnxruntime opens
    constants: dict[str, np.ndarray]  # the frozen tensors, inputs bound to the memory's one copy
    feedback: dict[str, str]  # state input -> the output holding its new value (after the guard)
    feeds: Feeds
    returned: list[str]  # the outputs brought back to the host
    in_place: bool
    gated: bool  # the guard reads the APPLY input (the capture's warm-up)
    not_fixed: str | None  # why the inputs and outputs are not at fixed addresses (None: they are)
    graph_capture: bool  # CUDA graphs planned
    not_captured: str | None  # why a fixed-address program on CUDA plans no CUDA graph (None: it does)
    provider: str  # the execution provider the graph was built for
    off_device: list[Placement]  # nodes ``provider`` has no kernel for (onnxruntime runs them on the CPU)
    where: str
    loss: str | None
    on_nonfinite: str


def plan_program(model: LargeModel, state: Container[str], feedback: Mapping[str, str], feeds: Feeds, *,
                 provider: str = CPU, device: str = "cpu", loss: str | None = None, on_nonfinite: str = "ignore",
                 in_place: bool | None = None, where: str = "step", fixed: bool = False,
                 cuda_graph: bool | None = None) -> ProgramPlan:
    """The plan of one graph program (see :class:`GraphProgram` for the arguments); ``model``
    is changed (guarded in place when its new state goes in place, frozen tensors made inputs).

    ``provider``: the execution provider the graph was built for; on CUDA its nodes are checked
    against onnxruntime's kernel table (:func:`~onnx_training_ops.runtime.kernel_table.cpu_nodes`).
    A node placed on the CPU brings Memcpy nodes, with which onnxruntime refuses CUDA graphs:
    none is planned then, unless ``cuda_graph=True`` (onnxruntime then decides, and refuses)."""
    proto = model.model_proto
    returned = [o.name for o in proto.graph.output if o.name not in set(feedback.values())]
    not_fixed: str | None = static_inputs_plan(proto, state, returned) if fixed else "not asked for"
    gate = APPLY if not_fixed is None and feedback else None
    placed, written = plan_in_place(proto, feedback, loss, on_nonfinite != "ignore", in_place, where, gate)
    if not_fixed is None and not placed:
        not_fixed = "the state is written into a second set (in place is unsafe or off)"
    returned = [o.name for o in proto.graph.output if o.name not in set(written.values())]
    model, constants = detached_as_inputs(model, on_cpu=provider == CPU)
    off_device = cpu_nodes(model.model_proto, provider) if provider in KERNEL_PROVIDERS else []
    capture, not_captured = not_fixed is None and captures(device), None
    if capture and off_device and not cuda_graph:
        capture, not_captured = False, f"onnxruntime refuses CUDA graphs with Memcpy nodes: " \
                                       f"{off_device_text(off_device, provider)}"
    return ProgramPlan(model, constants, written, feeds, returned, placed, placed and gate is not None, not_fixed,
                       capture, not_captured, provider, off_device, where, loss, on_nonfinite)


class GraphProgram:
    """One graph of standard ops over a :class:`~.memory.StateMemory`, opened from its
    :class:`ProgramPlan` (see the module doc).

    The plan's arguments (:func:`plan_program`):
        model: the graph (standard ops; state variables as inputs); guarded in place when its
            new state goes in place.
        feedback: state input -> the output holding its new value (empty: the graph only reads).
        feeds: what it takes from the host.
        loss: the loss output checked for non-finite values (None: no check).
        on_nonfinite: ``"raise"``, ``"skip"`` or ``"ignore"``.
        in_place: True, False or None (in place when safe): see :func:`plan_in_place`.
        where: names the program in errors (``"step"``, ``"backward"``...).
        fixed: bind every input and output once, at fixed addresses, when
            :func:`static_inputs_plan` allows it and the state goes in place; on a CUDA device
            with CUDA graphs (``enable_cuda_graph``).

    Args:
        plan: the program as planned.
        memory: the state it reads and writes.
        options: makes fresh onnxruntime options (one object per session: onnxruntime refuses
            external initializers added twice to one).
        providers: the execution providers.
    """

    def __init__(self, plan: ProgramPlan, memory: StateMemory, options: Callable[[], ort.SessionOptions],
                 providers: Sequence[Any]) -> None:
        self.memory, self.where, self.on_nonfinite, self.loss = memory, plan.where, plan.on_nonfinite, plan.loss
        self.feeds, self.feedback, self.returned = plan.feeds, plan.feedback, plan.returned
        self.in_place, self.gated, self.not_fixed = plan.in_place, plan.gated, plan.not_fixed
        self.graph_capture, self.off_device, self.provider = plan.graph_capture, plan.off_device, plan.provider
        self.not_captured = plan.not_captured  # why no CUDA graph was planned, or onnxruntime refused one
        self.session = self._open(plan.model, options, providers)
        inputs = [i.name for i in self.session.get_inputs()]
        self.reads = [name for name in inputs if name in memory and name not in plan.constants]
        missing = [n for n in self.feedback if n not in inputs]
        if missing:
            raise TrainingOpError(f"{self.where}: the state variable(s) {missing} are fed back but not read")
        self.constants = {n: a for n, a in plan.constants.items() if n in inputs}
        self._io: Any = None  # the one binding of a fixed-address program (made on its first run)
        self._bound: dict[tuple, Any] = {}  # the state's buffers -> a binding to them
        self._fixed_inputs: dict[str, ort.OrtValue] = {}
        self._fixed_outputs: list[ort.OrtValue] = []

    # ------------------------------------------------------------------ what the engine reads

    @property
    def required(self) -> list[FeedSpec]:
        return self.feeds.required

    @property
    def optional(self) -> list[FeedSpec]:
        return self.feeds.optional

    @property
    def rate_defaults(self) -> Mapping[str, np.ndarray | None]:
        return self.feeds.rate_defaults

    @property
    def writes(self) -> list[str]:
        """The state variables a run writes."""
        return list(self.feedback)

    @property
    def cut_nodes(self) -> list[onnx.NodeProto]:
        return []  # every update runs in the graph

    def _open(self, model: LargeModel, options: Callable[[], ort.SessionOptions], providers: Sequence[Any]) -> Any:
        """The onnxruntime session; with CUDA graphs when planned, else (onnxruntime refuses to
        capture a graph with a node off the CUDA EP) without them, the reason kept. Each try has
        options of its own: onnxruntime refuses the same external initializer added twice."""
        if self.graph_capture:
            try:
                return InferenceSession(model, sess_options=options(), providers=with_graph_capture(providers))
            except Exception as error:  # noqa: BLE001 - the reason is reported by graph_capture
                self.graph_capture = False  # the buffers stay at fixed addresses: no binding per step
                self.not_captured = f"onnxruntime refused CUDA graphs: {str(error).splitlines()[0]}"
                if self.off_device:
                    self.not_captured += f" ({off_device_text(self.off_device, self.provider)})"
        return InferenceSession(model, sess_options=options(), providers=providers)

    # ------------------------------------------------------------------ runs

    def run(self, feeds: Mapping[str, Any], rates: float | Mapping[str, float] | None = None,
            then: Callable[[bool], None] | None = None) -> dict[str, np.ndarray]:
        """One run; returns the returned outputs.

        Args:
            feeds: the batch (host arrays; names checked by the caller).
            rates: this run's learning rates (one for all, or per input), None: the defaults.
            then: ``then(skipped)``, called inside the state's write (Ctrl-C cannot split them).

        Raises:
            NonFiniteLossError: the loss was not finite and ``on_nonfinite="raise"`` (state unchanged).
            TrainingOpError: a bad feed, or onnxruntime failed (its message, naming the program).
        """
        host = self.feeds.host(feeds, rates, self.where)
        if not self.feedback:  # reads only
            result, skipped = self._run(host)
            if then is not None:
                then(skipped)
            return result
        if self.in_place:  # onnxruntime writes the state: the run and the bookkeeping are one write
            with held_interrupts():
                result, skipped = self._run(host)
                if then is not None:
                    then(skipped)
            return result
        result, skipped = self._run(host)  # into the spares: a Ctrl-C here cancels the step
        with held_interrupts():
            if not skipped:
                self.memory.commit(self.feedback)
            if then is not None:
                then(skipped)
        return result

    def _run(self, host: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], bool]:
        """Bind, run, bring the returned values back; (values, skipped for a non-finite loss)."""
        if self.not_fixed is None:
            io, outputs = self._fixed_binding(host), self._fixed_outputs
        else:
            io, outputs = self._binding(host), None
        self._execute(io)
        if outputs is None:
            outputs = io.get_outputs()[len(self.feedback):]
        result = {name: _host(value) for name, value in zip(self.returned, outputs)}
        if self.loss in result and self.on_nonfinite != "ignore":
            loss = result[self.loss]
            if not np.all(np.isfinite(loss)):
                if self.on_nonfinite == "raise":
                    raise NonFiniteLossError(f"{self.where}: loss {self.loss!r} is {loss.reshape(-1)[0]}; the step "
                                             "was not applied, the state is unchanged")
                return result, True
        return result, False

    def _execute(self, io: Any) -> None:
        try:
            self.session.run_with_iobinding(io)
        except TrainingOpError:
            raise
        except Exception as error:  # onnxruntime's own errors: name what failed
            raise TrainingOpError(f"{self.where}: onnxruntime failed on the device program: {error}") from error

    def _bind_state(self, io: Any) -> None:
        memory = self.memory
        for name in self.reads:
            memory.bind_input(io, name, name)
        for name, array in self.constants.items():
            io.bind_ortvalue_input(name, memory.constant(name, array))

    def _binding(self, feeds: Mapping[str, np.ndarray]) -> Any:
        """A binding for this run: the state's current buffers, the feeds from the host. The
        state's part is bound again only when its buffers changed (a two-set swap, here or in
        another program over the same memory): hundreds of binds a step otherwise."""
        memory = self.memory
        # the feeds' names too: a binding never keeps a value an earlier run fed that this one does not
        key = tuple(memory.token(n) for n in self.reads) + tuple(memory.token(n) for n in self.feedback) + tuple(feeds)
        cached = self._bound.get(key)
        if cached is None:
            cached = self.session.io_binding()
            self._bind_state(cached)
            for name, output in self.feedback.items():
                memory.bind_output(cached, output, name, spare=not self.in_place)
            if len(self._bound) >= 2:  # two sets: two bindings in turn
                self._bound.pop(next(iter(self._bound)))
            self._bound[key] = cached
        for name, array in feeds.items():
            cached.bind_cpu_input(name, array)  # copied up by onnxruntime
        if self.gated:
            cached.bind_cpu_input(APPLY, np.array(True))
        for name in self.returned:  # allocated by onnxruntime each run (a shape may change)
            cached.bind_output(name, "cpu")
        return cached

    def _fixed_binding(self, feeds: Mapping[str, np.ndarray]) -> Any:
        """The one binding, made on the first run with every input and output in a buffer of its
        own, and the warm-up run (its update turned off, see the module doc); each run copies
        the feeds into their buffers."""
        if self._io is None:
            self._io = self._bind_fixed(feeds)
            if self.gated:
                self._fixed_inputs[APPLY].update_inplace(np.array(False))
                self._copy_feeds(feeds)
                self._execute(self._io)  # onnxruntime may run it several times (CUDA graph capture)
                self._fixed_inputs[APPLY].update_inplace(np.array(True))
        self._copy_feeds(feeds)
        return self._io

    def _bind_fixed(self, feeds: Mapping[str, np.ndarray]) -> Any:
        memory, device, index = self.memory, self.memory.device, self.memory.device_id
        io = self.session.io_binding()
        self._bind_state(io)
        for name, output in self.feedback.items():
            memory.bind_output(io, output, name, spare=False)
        for vi in self.session.get_inputs():
            name = vi.name
            if name in memory or name in self.constants:
                continue
            if name == APPLY:
                value = ort.OrtValue.ortvalue_from_numpy(np.array(True), device, index)
            elif name not in feeds:
                raise TrainingOpError(f"{self.where}: input {name!r} is missing")
            else:
                value = ort.OrtValue.ortvalue_from_numpy(np.array(feeds[name], order="C"), device, index)
            self._fixed_inputs[name] = value
            io.bind_ortvalue_input(name, value)
        shapes = {o.name: (o.shape, o.type) for o in self.session.get_outputs()}
        for name in self.returned:
            shape, text = shapes[name]
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), _ONNX_TYPES[text], device, index)
            self._fixed_outputs.append(value)
            io.bind_ortvalue_output(name, value)
        return io

    def _copy_feeds(self, feeds: Mapping[str, Any]) -> None:
        for name, value in self._fixed_inputs.items():
            if name == APPLY:
                continue
            if name not in feeds:
                raise TrainingOpError(f"{self.where}: input {name!r} is missing")
            array = feeds[name]
            value.update_inplace(array if isinstance(array, np.ndarray) and array.flags.c_contiguous
                                 else np.array(array, order="C"))  # no host copy of a batch that needs none
        if self.memory.device != "cpu":
            # update_inplace copies on the default stream; the CUDA EP (and a captured graph) runs on
            # its own: order the copies before the run
            self._io.synchronize_inputs()


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


class GraphUpdate:
    """The in-graph strategy's program maker: a program's combined graph lowered to standard
    ops (:func:`~onnx_training_ops.prepare` with ``portable=True, flat=True``, the pass pipeline
    of the provider the graphs are for) and opened as a :class:`GraphProgram` over the
    session's memory. :meth:`plan_steps` is the same building without opening anything (what
    :func:`~.device_graphs.device_step_graphs` returns).

    Args:
        memory: the session's memory (state and accumulators), or a :class:`StateNames` to plan only.
        protos: the state variables' initializers.
        meta: the builder's metadata.
        on_nonfinite: the session's policy for a non-finite loss.
        options: makes fresh onnxruntime options for one session.
        providers: the execution providers.
        input_shapes: the step's data inputs' static shapes (or None).
        cuda_graph: None (when safe), True (an error when not possible) or False.
        in_place: None (when safe), True (an error when unsafe) or False (two sets).
        trainable: the trained parameters: in host memory laid out as one buffer before the
            first program binds them (``get_flat_parameters(copy=False)``).
        provider: the execution provider the graphs are built for (its passes: Conv gradients as
            cuDNN's Conv/ConvTranspose and GroupQueryAttention in standard ops on CUDA) and
            checked against (its kernel table); None: the memory's device's
            (:func:`device_provider`). A CUDA build on ``device="cpu"`` runs the GPU's graphs on
            the CPU.
    """

    name = "graph"

    def __init__(self, memory: StateMemory | StateNames, protos: Mapping[str, onnx.TensorProto],
                 meta: TrainingMetadata, on_nonfinite: str, options: Callable[[], ort.SessionOptions] | None,
                 providers: Sequence[Any], input_shapes: Mapping[str, Sequence[int]] | None = None,
                 cuda_graph: bool | None = None, in_place: bool | None = None, trainable: Sequence[str] = (),
                 provider: str | None = None) -> None:
        self.memory, self.protos, self.meta, self.on_nonfinite = memory, protos, meta, on_nonfinite
        self.trainable = list(trainable)
        self.options, self.providers = options, providers
        self.input_shapes, self.cuda_graph, self.in_place = input_shapes, cuda_graph, in_place
        self.provider = provider or device_provider(memory.device)

    def _loss(self, returned: Sequence[str]) -> str | None:
        return next((n for n in self.meta.loss if n in returned), None)

    def plan_steps(self, model: LargeModel, first: bool = True) -> list[ProgramPlan]:
        """One step plan per TrainingInfoProto of ``model`` (``first``: the session's own steps,
        with ``input_shapes`` and fixed addresses)."""
        proto = model.model_proto
        plans = []
        for i, info in enumerate(proto.training_info):
            combined = combined_graph(proto, i, self.protos, self.meta)
            feedback = {e.key: e.value for e in info.update_binding}
            returned = [o.name for o in combined.graph.output if o.name not in set(feedback.values())]
            plans.append(self.plan(model, combined, feedback, "step", self._loss(returned), self.on_nonfinite,
                                   static=first))
        return plans

    def open_steps(self, model: LargeModel, first: bool) -> list[GraphProgram]:
        if first and isinstance(self.memory, HostMemory):
            lay_out_flat(self.memory.arrays, [n for n in self.trainable if n in self.memory.arrays])
        return [self._opened(plan, first) for plan in self.plan_steps(model, first)]

    def open_evaluation(self, model: LargeModel) -> GraphProgram:
        combined = combined_graph(model.model_proto, 0, self.protos, self.meta, prune_inputs=True)
        return self.open(model, combined, {}, "evaluate")

    def open_stages(self, stages: Stages, protos: Mapping[str, onnx.TensorProto],
                    arrays: Mapping[str, np.ndarray]) -> list[GraphProgram]:
        apply_meta = self.meta.without_loss()
        programs = []
        for stage, meta, where in ((stages.backward, self.meta, "backward"),
                                   (stages.apply, apply_meta, "optimizer_step")):
            combined = combined_graph(stage, 0, protos, meta, prune_inputs=True)
            feedback = {e.key: e.value for e in stage.training_info[0].update_binding}
            returned = [o.name for o in combined.graph.output if o.name not in set(feedback.values())]
            backward = where == "backward"
            programs.append(self.open(LargeModel(stage, dict(arrays)), combined, feedback, where,
                                      self._loss(returned) if backward else None,
                                      self.on_nonfinite if backward else "ignore"))
        return programs

    def plan(self, model: LargeModel, combined: onnx.ModelProto, feedback: Mapping[str, str], where: str,
             loss: str | None = None, on_nonfinite: str = "ignore", static: bool = False) -> ProgramPlan:
        """The plan of a program for ``combined`` (state as inputs; ``model`` holds its big
        arrays). ``static``: the step, whose data inputs get ``input_shapes`` and whose buffers
        may sit at fixed addresses (CUDA graphs)."""
        graph = combined.graph
        memory = self.memory
        initial = {t.name: t for t in graph.initializer}
        types = {vi.name: vi for vi in graph.input}
        named = self.meta.learning_rate
        _, rate_defaults = learning_rate_inputs(graph, memory, types, initial, named)
        input_defaults = {vi.name: np.ascontiguousarray(tensor_value(initial[vi.name], model.large_initializers))
                          for vi in graph.input
                          if vi.name in initial and vi.name not in memory and vi.name not in rate_defaults}
        portable = prepare_model(model.with_proto(combined), portable=True, flat=True, gpu=self.provider == CUDA)
        # every input with a stored default (the learning rates among them) a plain input, fed
        # every run with the default when not given: onnxruntime's IOBinding cannot bind such an
        # input ("Failed to find NodeArg"), and a binding kept from run to run must never hold a
        # value an earlier run fed
        drop_named(portable.model_proto.graph.initializer, set(rate_defaults) | set(input_defaults))
        if static and self.input_shapes is not None:
            data = [vi.name for vi in portable.model_proto.graph.input if vi.name not in memory]
            portable = portable.with_proto(static_graph(portable.model_proto, data, self.input_shapes,
                                                        "input_shapes"))
        required: list[FeedSpec] = []
        optional: list[FeedSpec] = []
        folded = {vi.name: vi for vi in portable.model_proto.graph.input}
        for vi in graph.input:
            if vi.name in memory:
                continue
            spec = feed_spec(folded.get(vi.name, vi))
            (optional if vi.name in initial or vi.name in rate_defaults else required).append(spec)
        return plan_program(portable, memory, feedback, Feeds(required, optional, rate_defaults, input_defaults),
                            provider=self.provider, device=memory.device, loss=loss, on_nonfinite=on_nonfinite,
                            in_place=self.in_place if feedback else None, where=where,
                            fixed=static and self.cuda_graph is not False, cuda_graph=self.cuda_graph)

    def open(self, model: LargeModel, combined: onnx.ModelProto, feedback: Mapping[str, str], where: str,
             loss: str | None = None, on_nonfinite: str = "ignore", static: bool = False) -> GraphProgram:
        """A program for ``combined`` (:meth:`plan`, then opened over the memory)."""
        return self._opened(self.plan(model, combined, feedback, where, loss, on_nonfinite, static), static)

    def _opened(self, plan: ProgramPlan, static: bool) -> GraphProgram:
        memory = self.memory
        if isinstance(memory, StateNames) or self.options is None:
            raise TrainingOpError("this GraphUpdate plans only: it has no memory or options to open programs with")
        program = GraphProgram(plan, memory, self.options, self.providers)
        if static and plan.off_device:
            warnings.warn(f"{plan.where}: {off_device_text(plan.off_device, plan.provider)}. onnxruntime copies "
                          "their inputs and outputs between host and device every step (Memcpy nodes) and refuses "
                          "CUDA graphs for such a step", stacklevel=2)
        if static and self.cuda_graph and not program.graph_capture:
            reasons = [r for r in (program.not_fixed, program.not_captured, None if memory.device == "cuda" else
                                   f"the state is on {memory.device!r}, not a CUDA device") if r]
            raise TrainingOpError(f"cuda_graph=True but this step cannot be captured: {'; '.join(reasons)}")
        return program


__all__ = ["APPLY", "Feeds", "GraphProgram", "GraphUpdate", "loss_is_scalar", "plan_in_place", "static_inputs_plan",
           "with_graph_capture"]
