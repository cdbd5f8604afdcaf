"""TrainingSession: run an ONNX training model (``ModelProto.training_info``) in stock onnxruntime.

A training model is a stateful object (onnx ``docs/IR.md``): its *state variables* are the
initializers named as keys of an ``update_binding`` or ``initialization_binding``. The
session keeps each in one numpy array for its whole life; onnxruntime reads these arrays
zero-copy (``OrtValue.ortvalue_from_numpy`` + IOBinding), so state never round-trips
through fresh arrays between steps.

``step(feeds)`` runs every TrainingInfoProto's algorithm in order. As the spec says, the
algorithm runs on the main graph *and* the algorithm graph concatenated; the session
builds that graph once, turns state initializers into inputs bound to the state arrays and
:func:`~onnx_training_ops.prepare`-s it (Gradient expansion, plugin kernels).

**Fast path** (``fast=True``, the default): an optimizer node whose outputs feed only the
``update_binding`` of the very state variables it reads (X <- X_new, V <- V_new, H <- H_new)
is cut out of the graph onnxruntime runs. onnxruntime computes the rest (forward, loss,
gradients — the optimizer's other inputs become extra outputs written into preallocated
buffers) and then the update runs in place on the state arrays with the fused kernels
(:data:`onnx_training_ops.kernels.apply.STEPS`); the X, V, H and G of a multi-tensor node
are views into one flat buffer per role, so one kernel call updates the whole node.
``fast=False`` runs the whole graph, the
optimizer nodes included, in onnxruntime through the PyOp plugin; both run the same kernel
code on the same values, so they agree bit for bit.

**Non-finite loss**: after onnxruntime ran and *before* any state is written, the loss
outputs (the builder's ``loss``; for other models every returned float output of one
element) are checked. ``on_nonfinite="raise"`` (default) raises
:class:`NonFiniteLossError` and leaves every state variable (parameters, V, H, T) as it
was before the step; ``"skip"`` does the same without raising (the step is dropped,
``skipped_steps`` counts it, the returned dict has the loss); ``"ignore"`` trains through.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from . import checkpoint
from .builder import META_PREFIX, metadata
from .errors import TrainingOpError, node_label
from .kernels.apply import STEPS
from .passes import ModelLike, load_model
from .passes._graph import all_graphs, subgraphs, value_types
from .passes.encode_exact_attributes import node_attributes
from .passes.fill_defaults import fill_default_attributes
from .passes.fit_runtime import fit_runtime
from .schema import DOMAIN, OPTIMIZERS
from .session import InferenceSession

NONFINITE_POLICIES = ("raise", "skip", "ignore")


class NonFiniteLossError(TrainingOpError):
    """The loss of a step was NaN or infinite; the step was not applied (state unchanged)."""


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _owned(array: np.ndarray) -> np.ndarray:
    """A C-contiguous, aligned, writeable array owning its memory (what the fused kernels want)."""
    return np.array(array, copy=True, order="C")


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every name read by a node of ``graph`` (subgraphs included) or listed as its output."""
    used: set[str] = set()
    for g in all_graphs(graph):
        for node in g.node:
            used.update(node.input)
    used.update(o.name for o in graph.output)
    used.discard("")
    return used


@dataclass
class _FeedSpec:
    name: str
    dtype: np.dtype
    shape: tuple  # ints, or None for a dynamic/symbolic dim; () for scalars


@dataclass
class _CutStep:
    """One tensor's optimizer update applied by the fast path, in place."""

    op_type: str
    label: str
    attributes: dict
    r: Any  # ndarray, or ("feed", name)
    t: Any
    tensors: list  # per input role (X, G, V[, H]): ndarray or ("feed", name)
    targets: list  # per output role: the state array it must end up in


@dataclass
class _Program:
    """One TrainingInfoProto's algorithm, ready to run."""

    index: int
    session: Any
    io: Any
    feeds: list[_FeedSpec]
    rate_inputs: dict[str, np.ndarray]  # learning-rate input -> its preallocated buffer
    rate_defaults: dict[str, np.ndarray | None]
    returned: list[str]  # outputs returned by step()
    loss_names: list[str]
    fixed_outputs: list[str]  # outputs written into preallocated buffers (bindings, cut inputs)
    fixed_buffers: dict[str, np.ndarray] = field(default_factory=dict)
    binding_copies: list[tuple[np.ndarray, str]] = field(default_factory=list)  # (state, output)
    cut_nodes: list[onnx.NodeProto] = field(default_factory=list)
    cut_sources: dict[str, Any] = field(default_factory=dict)
    plan: list[_CutStep] | None = None
    copy_plan: list[tuple[np.ndarray, np.ndarray]] | None = None
    keep_alive: list = field(default_factory=list)  # OrtValues bound to our buffers
    # set while analysing (before the session exists)
    combined: Any = None
    state_inputs: list = field(default_factory=list)
    init_values: dict = field(default_factory=dict)
    binding: dict = field(default_factory=dict)
    cut_outputs: set = field(default_factory=set)
    flat_nodes: dict = field(default_factory=dict)  # id(node) -> (flat buffers per role, shapes, offsets, G names, dtype)
    # set when the session opens / after the first run
    uses_plugin: bool = False
    run: Any = None
    needs_feeds: bool = False
    returned_buffers: list = field(default_factory=list)  # (name, preallocated buffer)
    returned_from_ort: list = field(default_factory=list)  # (name, output index)
    optional_feeds: list = field(default_factory=list)  # (_FeedSpec, default) of inputs with a default
    input_defaults: dict = field(default_factory=dict)  # input name -> its default (TensorProto)


class TrainingSession:
    """Run an ONNX training model: ``initialize()``, ``step(feeds)``, ``run(...)``, checkpoints.

    ``model_or_path``: a ModelProto, path or bytes of a model with ``training_info`` (from
    :func:`~onnx_training_ops.build_training_model` or written by hand following the IR
    spec). The state starts at the model's initializers, so a checkpoint written by
    :meth:`save` resumes where it stopped; call :meth:`initialize` to reset the state and run
    the initialization graphs (a model fresh from the builder is already in that state).
    """

    def __init__(
        self,
        model_or_path: ModelLike,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        *,
        fast: bool = True,
        on_nonfinite: str = "raise",
        sess_options: ort.SessionOptions | None = None,
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise TrainingOpError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, found {on_nonfinite!r}")
        model = load_model(model_or_path)
        if not model.training_info:
            raise TrainingOpError(
                "the model has no training_info: build one with onnx_training_ops.build_training_model, or use "
                "TrainingSession.from_graph for a plain graph with explicit state inputs and outputs"
            )
        self.fast = bool(fast)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self._sess_options = sess_options
        self._model = model
        self._meta = metadata(model)
        self._inference = None
        self._state_protos: dict[str, onnx.TensorProto] = {}
        self._state: dict[str, np.ndarray] = {}
        self._collect_state()
        analyses = [self._build_program(i) for i in range(len(model.training_info))]
        for program in analyses:  # before anything binds a state array: lay the cut state out flat
            self._flatten_cut_state(program)
        self._programs = [self._open_program(p) for p in analyses]
        self._required_feeds = {}
        for program in self._programs:
            for spec in program.feeds:
                self._required_feeds.setdefault(spec.name, spec)
        self._rate_names = list(dict.fromkeys(name for p in self._programs for name in p.rate_inputs))
        self._optional_feeds = set(self._rate_names) | {
            spec.name for p in self._programs for spec, _ in p.optional_feeds
        }
        self._required_set = set(self._required_feeds)
        self._init_sessions = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_graph(
        cls,
        model: ModelLike,
        feedback: Mapping[str, str],
        *,
        initial_state: Mapping[str, np.ndarray] | None = None,
        **kwargs: Any,
    ) -> "TrainingSession":
        """A session for a plain graph that holds the optimizer itself, with explicit state.

        ``feedback`` maps graph outputs to the graph inputs they replace after each step
        (``{"X_new": "X", "V_new": "V", "T_new": "T"}``). The initial value of each state
        input is its initializer (an input with a default) or ``initial_state[name]``.
        The graph becomes the algorithm of a training model whose main graph only holds
        the state, so :meth:`save` writes a regular training model.
        """
        return cls(graph_to_training_model(model, feedback, initial_state), **kwargs)

    def _collect_state(self) -> None:
        model = self._model
        main_inits = {t.name: t for t in model.graph.initializer}
        keys_seen: dict[str, str] = {}
        for i, info in enumerate(model.training_info):
            algo_inits = {t.name: t for t in info.algorithm.initializer}
            algo_outputs = {o.name for o in info.algorithm.output} | {o.name for o in model.graph.output}
            init_outputs = {o.name for o in info.initialization.output}
            for kind, binding, values in (
                ("update_binding", info.update_binding, algo_outputs),
                ("initialization_binding", info.initialization_binding, init_outputs),
            ):
                for entry in binding:
                    where = f"training_info[{i}].{kind}"
                    if entry.key in main_inits:
                        proto = main_inits[entry.key]
                    elif entry.key in algo_inits:
                        proto = algo_inits[entry.key]
                    else:
                        raise TrainingOpError(
                            f"{where}: key {entry.key!r} is not an initializer of the main graph or of "
                            f"training_info[{i}].algorithm; a state variable must be one"
                        )
                    if entry.value not in values:
                        graph = "algorithm graph or the main graph" if kind == "update_binding" else "initialization graph"
                        raise TrainingOpError(
                            f"{where}: {entry.key!r} <- {entry.value!r}: {entry.value!r} is not an output of the {graph}"
                        )
                    if kind == "update_binding":
                        if entry.key in keys_seen:
                            raise TrainingOpError(
                                f"{where}: state variable {entry.key!r} is bound twice (also in {keys_seen[entry.key]}); "
                                "the spec allows each key once"
                            )
                        keys_seen[entry.key] = where
                    if proto.data_location == onnx.TensorProto.EXTERNAL:
                        raise TrainingOpError(f"state variable {entry.key!r} uses external data; load it first")
                    self._state_protos.setdefault(entry.key, proto)
        for name, proto in self._state_protos.items():
            self._state[name] = _owned(numpy_helper.to_array(proto))

    def _combined_graph(self, index: int) -> onnx.ModelProto:
        """Main graph + algorithm graph of training_info[index], state initializers as inputs."""
        model, info = self._model, self._model.training_info[index]
        algo = info.algorithm
        g = onnx.GraphProto()
        g.name = f"{model.graph.name or 'main'}+algorithm{index}"
        g.node.extend(model.graph.node)
        g.node.extend(algo.node)
        used = _used_names(algo) | _used_names(model.graph)
        used |= {e.value for e in info.update_binding}
        inputs = {}
        for vi in (*model.graph.input, *algo.input):
            inputs.setdefault(vi.name, vi)
        for name in self._state:
            if name in used and name not in inputs:
                proto = self._state_protos[name]
                inputs[name] = helper.make_tensor_value_info(name, proto.data_type, list(proto.dims))
        g.input.extend(inputs.values())
        for tensor in (*model.graph.initializer, *algo.initializer):
            if tensor.name not in self._state:
                g.initializer.append(tensor)
        g.sparse_initializer.extend(model.graph.sparse_initializer)
        g.sparse_initializer.extend(algo.sparse_initializer)
        g.value_info.extend(model.graph.value_info)
        g.value_info.extend(algo.value_info)
        outputs = {o.name: o for o in algo.output}
        main_outputs = {o.name: o for o in model.graph.output}
        for entry in info.update_binding:
            if entry.value not in outputs:
                outputs[entry.value] = main_outputs[entry.value]
        for name in self._meta.get("loss", "").split(","):  # a loss the main graph outputs
            if name in main_outputs and name not in outputs:
                outputs[name] = main_outputs[name]
        g.output.extend(outputs.values())
        combined = helper.make_model(g, opset_imports=list(model.opset_import))
        combined.ir_version = model.ir_version
        combined.functions.extend(model.functions)
        if not any(o.domain == DOMAIN for o in combined.opset_import) and any(
            n.domain == DOMAIN for n in algo.node
        ):
            combined.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        try:
            onnx.checker.check_model(combined)
        except onnx.checker.ValidationError as error:
            raise TrainingOpError(
                f"training_info[{index}]: the main graph and the algorithm graph together do not form a valid "
                f"graph (the spec runs them concatenated): {str(error).splitlines()[0]}"
            ) from error
        return combined

    def _check_binding_types(self, index: int, combined: onnx.ModelProto) -> None:
        info = self._model.training_info[index]
        types = value_types(combined)
        for entry in info.update_binding:
            vt = types.get(entry.value)
            state = self._state[entry.key]
            if vt is None:
                continue
            if vt.elem_type and _np_dtype(vt.elem_type) != state.dtype:
                raise TrainingOpError(
                    f"training_info[{index}].update_binding: state variable {entry.key!r} is "
                    f"{_dtype_name(state.dtype)} {list(state.shape)} but its new value {entry.value!r} is "
                    f"{vt.dtype_name}"
                )
            shape = vt.static_shape
            if shape is not None and tuple(shape) != state.shape:
                raise TrainingOpError(
                    f"training_info[{index}].update_binding: state variable {entry.key!r} has shape "
                    f"{list(state.shape)} but its new value {entry.value!r} has shape {list(shape)}"
                )

    def _build_program(self, index: int) -> _Program:
        info = self._model.training_info[index]
        combined = self._combined_graph(index)
        self._check_binding_types(index, combined)
        graph = combined.graph
        binding = {e.key: e.value for e in info.update_binding}
        bound_values = set(binding.values())
        state_inputs = [vi.name for vi in graph.input if vi.name in self._state]
        init_values = {t.name: t for t in graph.initializer}

        # learning-rate inputs: graph inputs that are R of an optimizer node
        rate_inputs: dict[str, np.ndarray] = {}
        rate_defaults: dict[str, np.ndarray | None] = {}
        input_types = {vi.name: vi for vi in graph.input}
        for node in graph.node:
            if node.domain == DOMAIN and node.op_type in OPTIMIZERS and node.input:
                r = node.input[0]
                if r in input_types and r not in self._state and r not in rate_inputs:
                    tt = input_types[r].type.tensor_type
                    dtype = _np_dtype(tt.elem_type) if tt.elem_type else np.dtype(np.float32)
                    shape = tuple(d.dim_value for d in tt.shape.dim) if tt.HasField("shape") else ()
                    default = numpy_helper.to_array(init_values[r]) if r in init_values else None
                    buf = np.zeros(shape, dtype) if default is None else _owned(default.astype(dtype).reshape(shape))
                    rate_inputs[r] = buf
                    rate_defaults[r] = None if default is None else buf.copy()

        # inputs with a default (an initializer of the same name): the session binds them every step,
        # to the fed value or to the default it keeps, so the graph gets them as plain inputs
        defaults = {name: init_values.pop(name) for name in list(init_values) if name in input_types}
        program_defaults = {name: t for name, t in defaults.items() if name not in rate_inputs}
        if defaults:
            kept_inits = [t for t in graph.initializer if t.name not in defaults]
            del graph.initializer[:]
            graph.initializer.extend(kept_inits)

        cut_nodes: list[onnx.NodeProto] = []
        if self.fast:
            cut_nodes = self._cuttable(graph, binding, state_inputs)
        cut_outputs = {o for n in cut_nodes for o in n.output if o}
        if cut_nodes:
            keep = [n for n in graph.node if not any(n is c for c in cut_nodes)]
            del graph.node[:]
            graph.node.extend(keep)

        # what the graph onnxruntime runs must output
        produced = {o for n in graph.node for o in n.output if o}
        cut_sources: dict[str, Any] = {}
        extra_outputs: list[str] = []
        for node in cut_nodes:
            for name in node.input:
                if name in cut_sources:
                    continue
                if name in self._state:
                    cut_sources[name] = ("state", name)
                elif name in rate_inputs:
                    cut_sources[name] = rate_inputs[name]
                elif name in produced:
                    cut_sources[name] = ("output", name)
                    extra_outputs.append(name)
                elif name in init_values and name not in input_types:
                    cut_sources[name] = _owned(numpy_helper.to_array(init_values[name]))
                elif name in input_types:
                    cut_sources[name] = ("feed", name)
                else:
                    raise TrainingOpError(f"{node_label(node)}: input {name!r} is not defined in the graph")
        old_outputs = list(graph.output)
        del graph.output[:]
        graph.output.extend(o for o in old_outputs if o.name not in cut_outputs)
        present = {o.name for o in graph.output}
        for name in extra_outputs:
            if name not in present:
                graph.output.append(onnx.ValueInfoProto(name=name))
                present.add(name)

        returned = [o.name for o in old_outputs if o.name not in bound_values]
        loss_names = self._loss_names(graph, returned)
        fixed_outputs = [o.name for o in graph.output if o.name not in returned]

        program = _Program(
            index=index, session=None, io=None, feeds=[], rate_inputs=rate_inputs,
            rate_defaults=rate_defaults, returned=returned, loss_names=loss_names,
            fixed_outputs=fixed_outputs, cut_nodes=cut_nodes, cut_sources=cut_sources,
        )
        program.combined = combined
        program.state_inputs = state_inputs
        program.init_values = init_values
        program.input_defaults = program_defaults
        program.binding = binding
        program.cut_outputs = cut_outputs
        return program

    def _flatten_cut_state(self, program: _Program) -> None:
        """Re-home the X, V, H state of each cut node as views into one flat buffer per role,
        so the fast path updates all of a node's tensors with one fused kernel call."""
        program.flat_nodes = {}
        for node in program.cut_nodes:
            spec = OPTIMIZERS[node.op_type]
            n = spec.n_tensors(len(node.input))
            roles = {role: [node.input[2 + j * n + i] for i in range(n)] for j, role in enumerate(spec.tensor_inputs)}
            xs = [self._state[name] for name in roles["X"]]
            dtype = xs[0].dtype
            if n < 2 or any(x.dtype != dtype for x in xs):
                continue
            if any(self._state[name].shape != x.shape or self._state[name].dtype != dtype
                   for role, names in roles.items() if role != "G" for name, x in zip(names, xs)):
                continue
            if any(program.cut_sources[g][0] != "output" for g in roles["G"]) or len(set(roles["G"])) != n:
                continue
            sizes = [x.size for x in xs]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
            flat = {}
            for role, names in roles.items():
                if role == "G":
                    continue
                buf = np.empty(int(offsets[-1]), dtype)
                for name, x, a, b in zip(names, xs, offsets[:-1], offsets[1:]):
                    view = buf[a:b].reshape(x.shape)
                    view[...] = self._state[name]
                    self._state[name] = view
                flat[role] = buf
            program.flat_nodes[id(node)] = (flat, [x.shape for x in xs], offsets, roles["G"], dtype)

    def _open_program(self, program: _Program) -> _Program:
        """Create the onnxruntime session and the IOBinding of an analysed program."""
        combined, graph = program.combined, program.combined.graph
        state_inputs, rate_inputs, init_values = program.state_inputs, program.rate_inputs, program.init_values
        returned, fixed_outputs = program.returned, program.fixed_outputs
        session = InferenceSession(combined, sess_options=self._session_options(), providers=self._providers)
        io = session.io_binding()
        program.session, program.io = session, io
        # no plugin node left (all optimizers cut): call onnxruntime directly, no kernel-error bookkeeping
        program.uses_plugin = any(n.domain == DOMAIN for n in session.prepared_model.graph.node)
        program.run = session.run_with_iobinding if program.uses_plugin else None
        session_inputs = {i.name for i in session.get_inputs()}
        for name in state_inputs:
            if name not in session_inputs:
                continue
            value = ort.OrtValue.ortvalue_from_numpy(self._state[name])
            io.bind_ortvalue_input(name, value)
            program.keep_alive.append(value)
        for name, buf in rate_inputs.items():
            if name in session_inputs:
                value = ort.OrtValue.ortvalue_from_numpy(buf)
                io.bind_ortvalue_input(name, value)
                program.keep_alive.append(value)
        for vi in graph.input:
            if vi.name in self._state or vi.name in rate_inputs or vi.name not in session_inputs:
                continue
            tt = vi.type.tensor_type
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim
            ) if tt.HasField("shape") else None
            spec = _FeedSpec(vi.name, _np_dtype(tt.elem_type), shape)
            if vi.name in program.input_defaults:  # optional: bound every step, to the default if not fed
                default = _owned(numpy_helper.to_array(program.input_defaults[vi.name]))
                program.optional_feeds.append((spec, default))
            else:
                program.feeds.append(spec)
        for name in returned:
            io.bind_output(name, "cpu")
        for name in fixed_outputs:
            io.bind_output(name, "cpu")
        program.binding_copies = [
            (self._state[k], v) for k, v in program.binding.items() if v not in program.cut_outputs
        ]
        program.needs_feeds = any(type(src) is tuple and src[0] == "feed" for src in program.cut_sources.values())
        del program.combined  # the session holds what it needs
        return program

    def _session_options(self) -> ort.SessionOptions | None:
        if self._sess_options is None:
            return None
        # InferenceSession registers the kernel library in the options it gets: give each its own copy.
        so = ort.SessionOptions()
        for attr in ("intra_op_num_threads", "inter_op_num_threads", "graph_optimization_level",
                     "execution_mode", "enable_mem_pattern", "enable_cpu_mem_arena", "log_severity_level"):
            setattr(so, attr, getattr(self._sess_options, attr))
        return so

    def _loss_names(self, graph: onnx.GraphProto, returned: list[str]) -> list[str]:
        """The outputs the non-finite check watches: the builder's loss, else the returned
        float outputs of one element."""
        named = [n for n in self._meta.get("loss", "").split(",") if n in returned]
        if named:
            return named
        types = value_types(onnx.helper.make_model(graph))
        found = []
        floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
        for name in returned:
            vt = types.get(name)
            if vt is not None and vt.elem_type in floats and vt.shape is not None and all(d == 1 for d in vt.shape):
                found.append(name)
        return found

    def _cuttable(self, graph: onnx.GraphProto, binding: dict[str, str], state_inputs: list[str]) -> list:
        """The optimizer nodes the fast path applies in place instead of onnxruntime."""
        consumed: dict[str, int] = {}
        for node in graph.node:
            for name in node.input:
                consumed[name] = consumed.get(name, 0) + 1
            for sub in subgraphs(node):
                for g in all_graphs(sub):
                    for n in g.node:
                        for name in n.input:
                            consumed[name] = consumed.get(name, 0) + 1
        reverse: dict[str, list[str]] = {}
        for key, value in binding.items():
            reverse.setdefault(value, []).append(key)
        state = set(state_inputs)
        written: set[str] = set()
        read: set[str] = set()
        cut = []
        for node in graph.node:
            if node.domain != DOMAIN or node.op_type not in OPTIMIZERS:
                continue
            spec = OPTIMIZERS[node.op_type]
            n = spec.n_tensors(len(node.input))
            if n is None or len(node.output) != n * spec.n_groups_out:
                continue  # invalid: prepare() reports it
            ok = True
            node_written, node_read = set(), set()
            for i in range(n):
                for j, role in enumerate(spec.tensor_inputs):
                    name = node.input[2 + j * n + i]
                    if role == "G":
                        node_read.add(name)
                        continue
                    out = node.output[spec.tensor_outputs.index(role + "_new") * n + i]
                    if (
                        name not in state
                        or binding.get(name) != out
                        or reverse.get(out) != [name]
                        or consumed.get(out, 0)
                        or name in node_written
                    ):
                        ok = False
                    node_written.add(name)
            node_read.update(node.input[:2])
            if not ok or node_written & (written | read) or node_read & (written | node_written):
                continue
            written |= node_written
            read |= node_read
            cut.append(node)
        return cut

    # ------------------------------------------------------------------ state

    @property
    def state_names(self) -> list[str]:
        """Names of the state variables (parameters, optimizer state, update count)."""
        return list(self._state)

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state variable."""
        return {name: value.copy() for name, value in self._state.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy values into the state variables (same dtype and shape required).

        With ``strict`` the keys must be exactly the state variables; otherwise unknown keys
        raise and missing ones keep their value.
        """
        unknown = [k for k in state if k not in self._state]
        if unknown:
            raise TrainingOpError(f"load_state_dict: unknown state variable(s) {unknown}; known: {self.state_names}")
        if strict:
            missing = [k for k in self._state if k not in state]
            if missing:
                raise TrainingOpError(f"load_state_dict: missing state variable(s) {missing}")
        checked = {}
        for name, value in state.items():
            target = self._state[name]
            value = np.asarray(value)
            if value.dtype != target.dtype:
                raise TrainingOpError(
                    f"load_state_dict: state variable {name!r} is {_dtype_name(target.dtype)}, found {_dtype_name(value.dtype)}"
                )
            if value.shape != target.shape:
                raise TrainingOpError(
                    f"load_state_dict: state variable {name!r} has shape {list(target.shape)}, found {list(value.shape)}"
                )
            checked[name] = value
        for name, value in checked.items():
            np.copyto(self._state[name], value)

    def initialize(self) -> None:
        """Reset every state variable to its initializer, then run the initialization graphs."""
        for name, proto in self._state_protos.items():
            np.copyto(self._state[name], numpy_helper.to_array(proto))
        if self._init_sessions is None:
            self._init_sessions = []
            for info in self._model.training_info:
                init = info.initialization
                if not info.initialization_binding:
                    self._init_sessions.append(None)
                    continue
                m = helper.make_model(init, opset_imports=list(self._model.opset_import))
                m.ir_version = self._model.ir_version
                m.functions.extend(self._model.functions)
                sess = InferenceSession(m, providers=self._providers)
                self._init_sessions.append(sess)
        for info, sess in zip(self._model.training_info, self._init_sessions):
            if sess is None:
                continue
            names = [e.value for e in info.initialization_binding]
            values = sess.run(names, {})
            for entry, value in zip(info.initialization_binding, values):
                self._assign(entry.key, value, f"initialization_binding {entry.key!r} <- {entry.value!r}")

    def _assign(self, name: str, value: np.ndarray, what: str) -> None:
        target = self._state[name]
        value = np.asarray(value)
        if value.dtype != target.dtype or value.shape != target.shape:
            raise TrainingOpError(
                f"{what}: state variable {name!r} is {_dtype_name(target.dtype)} {list(target.shape)}, "
                f"the value is {_dtype_name(value.dtype)} {list(value.shape)}"
            )
        np.copyto(target, value)

    # ------------------------------------------------------------------ steps

    @property
    def feed_names(self) -> list[str]:
        """Inputs ``step`` needs (learning-rate inputs are optional: ``lr=`` or their default)."""
        return list(self._required_feeds)

    @property
    def optional_feed_names(self) -> list[str]:
        """Inputs ``step`` takes but does not need: learning rates and inputs with a default value."""
        return sorted(self._optional_feeds)

    @property
    def learning_rate_names(self) -> list[str]:
        return list(self._rate_names)

    def _check_feeds(self, feeds: Mapping[str, Any]) -> None:
        names = set(feeds)
        missing = self._required_set - names
        extra = names - self._required_set - self._optional_feeds
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing feed(s) {sorted(missing)}")
            if extra:
                parts.append(f"unknown feed(s) {sorted(extra)}")
            raise TrainingOpError(
                f"step: {'; '.join(parts)}; the training step takes {sorted(self._required_set)}"
                + (f" (and optionally {sorted(self._optional_feeds)})" if self._optional_feeds else "")
            )

    @staticmethod
    def _feed_array(spec: _FeedSpec, value) -> np.ndarray:
        array = value if type(value) is np.ndarray else np.asarray(value)
        if array.dtype != spec.dtype:
            raise TrainingOpError(
                f"step: feed {spec.name!r} must be {_dtype_name(spec.dtype)}, found {_dtype_name(array.dtype)}"
            )
        shape = spec.shape
        if shape is not None:
            if array.ndim != len(shape) or any(d is not None and d != a for d, a in zip(shape, array.shape)):
                expected = [d if d is not None else "?" for d in shape]
                raise TrainingOpError(
                    f"step: feed {spec.name!r} must have shape {expected}, found {list(array.shape)}"
                )
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        return array

    def step(self, feeds: Mapping[str, Any], lr: float | None = None) -> dict[str, np.ndarray]:
        """One training step: run each algorithm, assign its outputs by ``update_binding``.

        ``feeds``: the algorithm's inputs (the model's inputs and e.g. ``labels``).
        ``lr``: the learning rate for this step (default: the model's value, or a feed of
        the learning-rate input). Returns the outputs not consumed by ``update_binding``
        (the loss, ...).
        """
        self._check_feeds(feeds)
        if lr is not None and not self._rate_names:
            raise TrainingOpError(
                "step: lr was given but no optimizer of this model takes its learning rate from a graph input "
                "(R is a constant or computed in the graph)"
            )
        result: dict[str, np.ndarray] = {}
        for program in self._programs:
            result.update(self._run_program(program, feeds, lr))
        return result

    def _run_program(self, program: _Program, feeds: Mapping[str, Any], lr) -> dict[str, np.ndarray]:
        io = program.io
        raw = io._iobinding
        arrays = []
        for spec in program.feeds:
            array = self._feed_array(spec, feeds[spec.name])
            arrays.append(array)
            raw.bind_input(spec.name, array)
        for spec, default in program.optional_feeds:
            value = feeds.get(spec.name)
            array = default if value is None else self._feed_array(spec, value)
            arrays.append(array)
            raw.bind_input(spec.name, array)
        for name, buf in program.rate_inputs.items():
            if name in feeds:
                value = np.asarray(feeds[name])
                if value.size != 1:
                    raise TrainingOpError(f"step: learning rate {name!r} must be a scalar, found shape {list(value.shape)}")
                buf[...] = value.reshape(buf.shape)
            elif lr is not None:
                buf[...] = lr
            elif program.rate_defaults[name] is not None:
                buf[...] = program.rate_defaults[name]
            else:
                raise TrainingOpError(f"step: learning rate {name!r} has no default; pass lr=... or feed it")
        try:
            if program.run is None:
                program.session._sess.run_with_iobinding(raw, None)
            else:
                program.run(io)
        except TrainingOpError:
            raise
        except Exception as error:  # onnxruntime's own errors: name what failed
            raise TrainingOpError(f"step: onnxruntime failed on training_info[{program.index}]: {error}") from error
        if program.copy_plan is None:
            self._finish_binding(program)
        result = {}
        if program.returned_from_ort:
            outputs = raw.get_outputs()
            for name, i in program.returned_from_ort:
                result[name] = outputs[i].numpy()
        for name, buf in program.returned_buffers:
            result[name] = buf.copy()
        if self.on_nonfinite != "ignore":
            for name in program.loss_names:
                value = result[name]
                if not np.all(np.isfinite(value)):
                    if self.on_nonfinite == "raise":
                        raise NonFiniteLossError(
                            f"step: loss {name!r} is {value.reshape(-1)[0] if value.size else value} "
                            f"(training_info[{program.index}]); the step was not applied, the state is unchanged"
                        )
                    self.skipped_steps += 1
                    return result
        if program.needs_feeds:
            defaults = {spec.name: default for spec, default in program.optional_feeds}
            for s in program.plan:
                self._apply(s, {**defaults, **feeds})
        else:
            for s in program.plan:
                outs = STEPS[s.op_type](s.r, s.t, *s.tensors, s.attributes, inplace=True)
                for target, out in zip(s.targets, outs):
                    if out is not target:
                        np.copyto(target, out)
        for state, buf in program.copy_plan:
            np.copyto(state, buf)
        return result

    def _apply(self, s: _CutStep, feeds) -> None:
        r, t = s.r, s.t
        tensors = s.tensors
        if type(r) is tuple:
            r = np.asarray(feeds[r[1]])
        if type(t) is tuple:
            t = np.asarray(feeds[t[1]])
        if any(type(x) is tuple for x in tensors):
            tensors = [np.asarray(feeds[x[1]]) if type(x) is tuple else x for x in tensors]
        outs = STEPS[s.op_type](r, t, *tensors, s.attributes, inplace=True)
        for target, out in zip(s.targets, outs):
            if out is not target:
                np.copyto(target, out)

    def _finish_binding(self, program: _Program) -> None:
        """After the first run: preallocate the fixed outputs and rebind them zero-copy."""
        raw = program.io._iobinding
        outputs = raw.get_outputs()
        names = program.returned + program.fixed_outputs
        values = {name: outputs[i].numpy() for i, name in enumerate(names)}
        # gradients of a flat node: views into one flat buffer, the kernel's G
        flat_grads = {}
        for node in program.cut_nodes:
            entry = program.flat_nodes.get(id(node))
            if entry is None:
                continue
            flat, shapes, offsets, grads, dtype = entry
            if any(values[g].shape != shape or values[g].dtype != dtype for g, shape in zip(grads, shapes)):
                del program.flat_nodes[id(node)]  # gradients do not match X: per-tensor updates
                continue
            buf = np.empty(int(offsets[-1]), dtype)
            for g, shape, a, b in zip(grads, shapes, offsets[:-1], offsets[1:]):
                flat_grads[g] = buf[a:b].reshape(shape)
            flat["G"] = buf
        for name in program.fixed_outputs:
            if name in flat_grads:
                buf = flat_grads[name]
                buf[...] = values[name]
            else:
                buf = _owned(values[name])
            program.fixed_buffers[name] = buf
            ov = ort.OrtValue.ortvalue_from_numpy(buf)
            program.io.bind_ortvalue_output(name, ov)
            program.keep_alive.append(ov)
        # returned outputs of one element (the loss): preallocated too; others onnxruntime allocates
        program.returned_buffers, program.returned_from_ort = [], []
        for i, name in enumerate(program.returned):
            value = values[name]
            if value.size == 1 and value.dtype != object:
                buf = _owned(value)
                ov = ort.OrtValue.ortvalue_from_numpy(buf)
                program.io.bind_ortvalue_output(name, ov)
                program.keep_alive.append(ov)
                program.returned_buffers.append((name, buf))
            else:
                program.returned_from_ort.append((name, i))
        copies = []
        for state, name in program.binding_copies:
            buf = program.fixed_buffers[name]
            if buf.dtype != state.dtype or buf.shape != state.shape:
                key = next(k for k, v in self._state.items() if v is state)
                raise TrainingOpError(
                    f"training_info[{program.index}].update_binding: state variable {key!r} is "
                    f"{_dtype_name(state.dtype)} {list(state.shape)} but {name!r} came out "
                    f"{_dtype_name(buf.dtype)} {list(buf.shape)}"
                )
            copies.append((state, buf))
        plan = []
        for node in program.cut_nodes:
            filled = onnx.ModelProto()
            filled.graph.node.append(node)
            fill_default_attributes(filled)
            attributes = node_attributes(filled.graph.node[0])
            spec = OPTIMIZERS[node.op_type]
            n = spec.n_tensors(len(node.input))

            def source(name):
                src = program.cut_sources[name]
                if type(src) is tuple and src[0] == "output":
                    return program.fixed_buffers[name]
                if type(src) is tuple and src[0] == "state":
                    return self._state[src[1]]
                return src

            entry = program.flat_nodes.get(id(node))
            if entry is not None:
                flat = entry[0]
                tensors = [flat[role] for role in spec.tensor_inputs]
                targets = [flat[role[:-4]] for role in spec.tensor_outputs]
                plan.append(_CutStep(node.op_type, node_label(node), attributes, source(node.input[0]),
                                     source(node.input[1]), tensors, targets))
                continue
            for i in range(n):
                tensors = [source(node.input[2 + j * n + i]) for j in range(spec.n_groups_in)]
                targets = []
                for role in spec.tensor_outputs:
                    j = spec.tensor_inputs.index(role[:-4])
                    targets.append(self._state[node.input[2 + j * n + i]])
                plan.append(
                    _CutStep(node.op_type, node_label(node), attributes, source(node.input[0]),
                             source(node.input[1]), tensors, targets)
                )
        program.plan = plan
        program.copy_plan = copies

    # ------------------------------------------------------------------ inference, export

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """Run the main (inference) graph with the current state; like ``InferenceSession.run``."""
        if self._inference is None:
            self._inference = self._build_inference()
        session, state_inputs = self._inference
        full = dict(feeds)
        for name in state_inputs:
            if name in full:
                raise TrainingOpError(f"run: {name!r} is a state variable, not a feed")
            full[name] = self._state[name]
        try:
            return session.run(output_names, full)
        except TrainingOpError:
            raise
        except Exception as error:
            raise TrainingOpError(f"run: {error}") from error

    def _build_inference(self):
        model = self._inference_model(with_state_values=False)
        graph = model.graph
        if not graph.output:
            raise TrainingOpError("run: the main graph has no outputs (a from_graph session has no inference graph)")
        state_inputs = []
        kept = []
        declared = {vi.name for vi in graph.input}
        for tensor in graph.initializer:
            if tensor.name in self._state:
                state_inputs.append(tensor.name)
                if tensor.name not in declared:
                    graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            else:
                kept.append(tensor)
        del graph.initializer[:]
        graph.initializer.extend(kept)
        session = InferenceSession(model, sess_options=self._session_options(), providers=self._providers)
        return session, state_inputs

    def _inference_model(self, with_state_values: bool = True) -> onnx.ModelProto:
        model = onnx.ModelProto()
        model.CopyFrom(self._model)
        del model.training_info[:]
        kept = [m for m in model.metadata_props if not m.key.startswith(META_PREFIX)]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        if with_state_values:
            for tensor in model.graph.initializer:
                if tensor.name in self._state:
                    checkpoint.set_initializer(tensor, self._state[tensor.name])
        uses_domain = any(n.domain == DOMAIN for g in all_graphs(model.graph) for n in g.node)
        if not uses_domain:
            kept_ops = [o for o in model.opset_import if o.domain != DOMAIN]
            del model.opset_import[:]
            model.opset_import.extend(kept_ops)
        return fit_runtime(model)

    def training_model(self) -> onnx.ModelProto:
        """The training model with the current state as initializers (what :meth:`save` writes)."""
        return checkpoint.write_state(self._model, self._state)

    def save(self, path: str | os.PathLike) -> str:
        """Write the training model with the current state, atomically; reloading resumes bit-exact."""
        return checkpoint.save_model(self.training_model(), path)

    def export_inference_model(self, path: str | os.PathLike | None = None) -> onnx.ModelProto:
        """The main graph with the trained weights and no training_info (written to ``path`` if given)."""
        model = self._inference_model(with_state_values=True)
        if not model.graph.output:
            raise TrainingOpError("export_inference_model: the main graph has no outputs")
        if path is not None:
            checkpoint.save_model(model, path)
        return model

    # ------------------------------------------------------------------ introspection

    @property
    def fast_path_nodes(self) -> list[str]:
        """Labels of the optimizer nodes the fast path applies in place."""
        return [node_label(n) for p in self._programs for n in p.cut_nodes]

    @property
    def metadata(self) -> dict[str, str]:
        """The builder's metadata (optimizer, loss, labels, learning_rate, trainable), if any."""
        return dict(self._meta)


def graph_to_training_model(
    model: ModelLike, feedback: Mapping[str, str], initial_state: Mapping[str, np.ndarray] | None = None
) -> onnx.ModelProto:
    """A training model for a plain graph with explicit state (see :meth:`TrainingSession.from_graph`)."""
    model = load_model(model)
    graph = model.graph
    initial_state = dict(initial_state or {})
    inputs = {vi.name: vi for vi in graph.input}
    outputs = {vo.name for vo in graph.output}
    inits = {t.name: t for t in graph.initializer}
    if not feedback:
        raise TrainingOpError("from_graph: feedback is empty; map each new-state output to its state input")
    targets = {}
    for out, inp in feedback.items():
        if out not in outputs:
            raise TrainingOpError(
                f"from_graph: feedback {out!r} -> {inp!r}: {out!r} is not an output of the graph; "
                f"outputs: {sorted(outputs)}"
            )
        if inp not in inputs and inp not in inits:
            raise TrainingOpError(
                f"from_graph: feedback {out!r} -> {inp!r}: {inp!r} is not an input of the graph; "
                f"inputs: {sorted(inputs)}"
            )
        if inp in targets:
            raise TrainingOpError(f"from_graph: state input {inp!r} is fed back twice ({targets[inp]!r}, {out!r})")
        targets[inp] = out
    unknown = [k for k in initial_state if k not in targets]
    if unknown:
        raise TrainingOpError(f"from_graph: initial_state names {unknown} are not fed-back inputs {sorted(targets)}")
    state_tensors = []
    for name in targets:
        if name in initial_state:
            value = np.asarray(initial_state[name])
            if name in inputs:
                tt = inputs[name].type.tensor_type
                if tt.elem_type and _np_dtype(tt.elem_type) != value.dtype:
                    raise TrainingOpError(
                        f"from_graph: initial_state[{name!r}] is {_dtype_name(value.dtype)}, the input is "
                        f"{_dtype_name(_np_dtype(tt.elem_type))}"
                    )
            state_tensors.append(numpy_helper.from_array(value, name))
        elif name in inits:
            state_tensors.append(inits[name])
        else:
            raise TrainingOpError(
                f"from_graph: state input {name!r} has no initial value: give it an initializer or pass initial_state"
            )
    algo = onnx.GraphProto()
    algo.CopyFrom(graph)
    algo.name = "algorithm"
    kept_inputs = [vi for vi in algo.input if vi.name not in targets]
    del algo.input[:]
    algo.input.extend(kept_inputs)
    kept_inits = [t for t in algo.initializer if t.name not in targets]
    del algo.initializer[:]
    algo.initializer.extend(kept_inits)
    main = helper.make_graph([], "state", [], [], initializer=state_tensors)
    out = helper.make_model(main, opset_imports=list(model.opset_import))
    out.ir_version = max(model.ir_version, 7)
    out.functions.extend(model.functions)
    info = out.training_info.add()
    info.algorithm.CopyFrom(algo)
    for name, value in targets.items():
        info.update_binding.add(key=name, value=value)
    return out
