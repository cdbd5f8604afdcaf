"""Programs: one TrainingInfoProto's algorithm turned into the graph onnxruntime runs.

As the spec says, the algorithm runs on the main graph *and* the algorithm graph
concatenated; :func:`build_program` builds that graph once, turns state initializers into
inputs (bound to the state arrays when the program opens, see :mod:`.binding`), cuts the
optimizer nodes the fast path applies in place (:mod:`..fastpath.fast_path`) and lists what the graph
must output.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...passes._graph import value_types
from ...passes.validate import validate
from ...runtime.session import InferenceSession
from ...schema import DOMAIN, OPTIMIZERS
from ...storage.large_model import LargeModel
from ...walk import remove_nodes
from ..arrays import dtype_name, np_dtype, owned
from ..fastpath.fast_path import cut_sources, cuttable_nodes
from ..fastpath.gated_updates import regate, ungate
from ..fastpath.in_place_updates import CutNodes, InPlaceUpdate, RMSPropUpdates, RowUpdates
from ..fastpath.rmsprop_fast_path import rmsprop_groups
from ..fastpath.row_updates import row_groups
from ..fastpath.sources import FromOutput
from ..inputs.feeds import FeedSpec, checked_learning_rate
from .pruning import prune_dead_nodes, prune_unused_inputs, used_names


@dataclass(frozen=True, slots=True)
class Analysis:
    """What :func:`build_program` finds in one TrainingInfoProto: everything a session does
    around the graph onnxruntime runs (which :func:`build_program` returns beside it).

    The learning-rate buffers are allocated here (their defaults fill them); the in-place
    updates plan themselves once the program has run (:mod:`..fastpath.in_place_updates`).
    """

    index: int
    where: str  # the method whose run this is, as messages name it
    state_inputs: tuple[str, ...]  # graph inputs bound to state arrays
    binding: Mapping[str, str]  # state variable -> the output holding its new value
    rate_inputs: Mapping[str, np.ndarray]  # learning-rate input -> its preallocated buffer
    rate_defaults: Mapping[str, np.ndarray | None]
    input_defaults: Mapping[str, onnx.TensorProto]  # inputs with a default value (optional feeds)
    returned: tuple[str, ...]  # outputs returned by step()
    loss_names: tuple[str, ...]  # outputs the non-finite check watches
    fixed_outputs: tuple[str, ...]  # outputs written into preallocated buffers (bindings, cut inputs)
    dynamic_outputs: tuple[str, ...]  # outputs of varying shape the in-place updates read
    cut_outputs: frozenset[str]  # outputs of cut nodes (written in place, never by onnxruntime)
    cut: CutNodes  # the fast path's optimizer nodes
    updates: tuple[InPlaceUpdate, ...]  # every in-place update, in the order a step applies them


@dataclass(slots=True)
class Program:
    """An analysed program opened on one state: its onnxruntime session, IOBinding and buffers
    (:func:`.binding.open_program`; the buffers after the first run, :func:`.binding.finish_binding`)."""

    analysis: Analysis
    session: InferenceSession
    io: ort.IOBinding
    feeds: list[FeedSpec] = field(default_factory=list)
    optional_feeds: list[tuple[FeedSpec, np.ndarray]] = field(default_factory=list)  # with their defaults
    in_place: dict[str, str] = field(default_factory=dict)  # optimizer output -> the state it is written into
    guarded: bool = False  # a non-finite loss stops the run before the optimizers (.in_place)
    uses_plugin: bool = False  # a plugin node is left in the graph (else every optimizer was cut)
    run: Callable[[ort.IOBinding], None] | None = None  # session.run_with_iobinding with a plugin node left
    needs_feeds: bool = False  # an in-place update reads a feed
    keep_alive: list[Any] = field(default_factory=list)  # OrtValues (and arrays) bound to the session
    prebound: dict[str, np.ndarray] = field(default_factory=dict)  # gradient -> its view in a flat G buffer
    bound_feeds: dict[str, Any] = field(default_factory=dict)  # feed name -> (array, shape, dtype) bound last step
    fallback: Program | Callable[[], Program] | None = None  # the same program without in-place writes
    # after the first run
    fixed_buffers: dict[str, np.ndarray] = field(default_factory=dict)
    binding_copies: list[tuple[np.ndarray, str]] = field(default_factory=list)  # (state, output)
    copy_plan: list[tuple[np.ndarray, np.ndarray]] | None = None  # None until the first run
    updates: tuple[InPlaceUpdate, ...] = ()  # the analysis's in-place updates with work to do, once planned
    returned_buffers: list[tuple[str, np.ndarray]] = field(default_factory=list)
    returned_from_ort: list[tuple[str, int]] = field(default_factory=list)  # (name, output index)

    @property
    def index(self) -> int:
        return self.analysis.index

    @property
    def where(self) -> str:
        return self.analysis.where

    @property
    def rate_inputs(self) -> Mapping[str, np.ndarray]:
        return self.analysis.rate_inputs

    @property
    def cut_nodes(self) -> list[onnx.NodeProto]:
        """The optimizer nodes the fast path applies in place."""
        return self.analysis.cut.nodes


def combined_graph(
    model: onnx.ModelProto, index: int, state_protos: Mapping[str, onnx.TensorProto], meta: TrainingMetadata,
    prune_inputs: bool = False,
) -> onnx.ModelProto:
    """Main graph + algorithm graph of training_info[index], state initializers as inputs."""
    info = model.training_info[index]
    algo = info.algorithm
    g = onnx.GraphProto()
    g.name = f"{model.graph.name or 'main'}+algorithm{index}"
    g.node.extend(model.graph.node)
    g.node.extend(algo.node)
    used = used_names(algo) | used_names(model.graph)
    used |= {e.value for e in info.update_binding}
    inputs: dict[str, onnx.ValueInfoProto] = {}
    computed = {o for n in model.graph.node for o in n.output if o}
    for vi in (*model.graph.input, *algo.input):
        if vi.name not in computed:  # an algorithm input naming a main-graph value reads it
            inputs.setdefault(vi.name, vi)
    for name in state_protos:
        if name in used and name not in inputs:
            proto = state_protos[name]
            inputs[name] = helper.make_tensor_value_info(name, proto.data_type, list(proto.dims))
    g.input.extend(inputs.values())
    for tensor in (*model.graph.initializer, *algo.initializer):
        if tensor.name not in state_protos:
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
    for name in meta.loss:  # a loss the main graph outputs
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
    _complete_output_shapes(combined, {e.value: state_protos[e.key]
                                       for e in info.update_binding if e.key in state_protos})
    try:  # the spec's checks with our messages, before the fast path may cut optimizer nodes
        validate(combined)
    except TrainingOpError as error:
        raise TrainingOpError(f"training_info[{index}] (main graph + algorithm): {error}") from None
    try:
        onnx.checker.check_model(combined)
    except onnx.checker.ValidationError as error:
        raise TrainingOpError(
            f"training_info[{index}]: the main graph and the algorithm graph together do not form a valid "
            f"graph (the spec runs them concatenated): {str(error).splitlines()[0]}"
        ) from error
    prune_dead_nodes(combined.graph)  # after validation: a broken node nobody reads is still an error
    if prune_inputs:
        prune_unused_inputs(combined.graph)
    return combined


def _complete_output_shapes(model: onnx.ModelProto, bound: Mapping[str, onnx.TensorProto]) -> None:
    """Outputs declared without a type or a shape (the spec allows it; the checker wants both
    for the combined graph) get their state variable's (``bound``: output name -> the state's
    tensor) or what shape inference finds (unknown dims named)."""
    missing = [o for o in model.graph.output if not o.type.HasField("tensor_type")
               or not o.type.tensor_type.elem_type or not o.type.tensor_type.HasField("shape")]
    if not missing:
        return
    types = value_types(model)
    for out in missing:
        known = types.get(out.name)
        state = bound.get(out.name)
        if not out.type.tensor_type.elem_type:
            elem_type = state.data_type if state is not None else (known.elem_type if known else 0)
            if not elem_type:
                continue
            out.type.tensor_type.elem_type = elem_type
        if out.type.tensor_type.HasField("shape"):
            continue
        shape = list(state.dims) if state is not None else (known.shape if known is not None else None)
        if shape is None:
            continue
        out.type.tensor_type.shape.SetInParent()  # a scalar has a shape with no dims
        dims = out.type.tensor_type.shape.dim
        for i, d in enumerate(shape):
            dim = dims.add()
            if isinstance(d, int):
                dim.dim_value = d
            else:
                dim.dim_param = d if isinstance(d, str) else f"{out.name}_dim{i}"


def check_binding_types(
    model: onnx.ModelProto, index: int, combined: onnx.ModelProto, state: Mapping[str, np.ndarray]
) -> None:
    """Raise if a new value of training_info[index].update_binding has another dtype or shape than its state."""
    info = model.training_info[index]
    types = value_types(combined)
    for entry in info.update_binding:
        vt = types.get(entry.value)
        array = state[entry.key]
        if vt is None:
            continue
        if vt.elem_type and np_dtype(vt.elem_type) != array.dtype:
            raise TrainingOpError(
                f"training_info[{index}].update_binding: state variable {entry.key!r} is "
                f"{dtype_name(array.dtype)} {list(array.shape)} but its new value {entry.value!r} is "
                f"{vt.dtype_name}"
            )
        shape = vt.static_shape
        if shape is not None and tuple(shape) != array.shape:
            raise TrainingOpError(
                f"training_info[{index}].update_binding: state variable {entry.key!r} has shape "
                f"{list(array.shape)} but its new value {entry.value!r} has shape {list(shape)}"
            )


def learning_rate_inputs(
    graph: onnx.GraphProto,
    state: Container[str],
    input_types: Mapping[str, onnx.ValueInfoProto],
    init_values: Mapping[str, onnx.TensorProto],
    named: tuple[str, ...] = (),
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray | None]]:
    """Graph inputs that are R of an optimizer node, or ``named`` (the builder's learning
    rate, which an optimizer of standard ops such as RMSProp reads): a preallocated buffer
    each, and its default (or None)."""
    rate_inputs: dict[str, np.ndarray] = {}
    rate_defaults: dict[str, np.ndarray | None] = {}
    candidates = [node.input[0] for node in graph.node
                  if node.domain == DOMAIN and node.op_type in OPTIMIZERS and node.input]
    for r in [*candidates, *named]:
        if r in input_types and r not in state and r not in rate_inputs:
            tt = input_types[r].type.tensor_type
            dtype = np_dtype(tt.elem_type) if tt.elem_type else np.dtype(np.float32)
            shape = tuple(d.dim_value for d in tt.shape.dim) if tt.HasField("shape") else ()
            default = numpy_helper.to_array(init_values[r]) if r in init_values else None
            if default is not None and default.size == 1:  # (other sizes: the binding check)
                checked_learning_rate(default.reshape(()), f"the default of learning rate {r!r}")
            buf = np.zeros(shape, dtype) if default is None else owned(default.astype(dtype).reshape(shape))
            rate_inputs[r] = buf
            rate_defaults[r] = None if default is None else buf.copy()
    return rate_inputs, rate_defaults


def loss_names(graph: onnx.GraphProto, returned: list[str], meta: TrainingMetadata) -> list[str]:
    """The outputs the non-finite check watches: the builder's loss, else the returned
    float outputs of one element."""
    named = [n for n in meta.loss if n in returned]
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


def drop_passthrough_bindings(graph: onnx.GraphProto, binding: dict[str, str]) -> None:
    """Forget bindings ``S <- Identity(S)`` (``binding`` and ``graph`` in place): the state
    keeps its value with no copy (a sharded optimizer's foreign parameters, see shard.py)."""
    same = {node.output[0] for node in graph.node
            if node.op_type == "Identity" and not node.domain and binding.get(node.input[0]) == node.output[0]}
    if not same:
        return
    for key in [k for k, v in binding.items() if v in same]:
        del binding[key]
    outputs = [o for o in graph.output if o.name not in same]
    del graph.output[:]
    graph.output.extend(outputs)
    prune_dead_nodes(graph)


def build_program(
    model: LargeModel,
    index: int,
    state: Mapping[str, np.ndarray],
    state_protos: Mapping[str, onnx.TensorProto],
    meta: TrainingMetadata,
    fast: bool,
    prune_inputs: bool = False,
    where: str = "step",
) -> tuple[LargeModel, Analysis]:
    """Analyse training_info[index]: its combined graph, learning rates, in-place updates and
    outputs.

    Args:
        model: the training model.
        index: which TrainingInfoProto.
        state: the state arrays (dtypes and shapes are checked against the bindings).
        state_protos: the state variables' initializers.
        meta: the builder's metadata.
        fast: cut the updates the session applies in place (:mod:`..fastpath.in_place_updates`).
        prune_inputs: drop the inputs nothing reads (the stage programs).
        where: the method the program runs for, as its messages name it.

    Returns:
        The graph onnxruntime runs (its detached constants still ``model``'s arrays) and the
        :class:`Analysis`.

    Raises:
        TrainingOpError: an invalid combined graph or a binding of another dtype or shape.
    """
    source = model
    arrays = model.large_initializers
    model = model.model_proto
    info = model.training_info[index]
    combined = combined_graph(model, index, state_protos, meta, prune_inputs)
    check_binding_types(model, index, combined, state)
    graph = combined.graph
    binding = {e.key: e.value for e in info.update_binding}
    drop_passthrough_bindings(graph, binding)
    bound_values = set(binding.values())
    state_inputs = [vi.name for vi in graph.input if vi.name in state]
    init_values = {t.name: t for t in graph.initializer}
    input_types = {vi.name: vi for vi in graph.input}
    rate_inputs, rate_defaults = learning_rate_inputs(graph, state, input_types, init_values,
                                                      meta.learning_rate)

    # inputs with a default (an initializer of the same name): the session binds them every step,
    # to the fed value or to the default it keeps, so the graph gets them as plain inputs
    defaults = {name: init_values.pop(name) for name in list(init_values) if name in input_types}
    program_defaults = {name: t for name, t in defaults.items() if name not in rate_inputs}
    if defaults:
        kept_inits = [t for t in graph.initializer if t.name not in defaults]
        del graph.initializer[:]
        graph.initializer.extend(kept_inits)

    cut_nodes: list[onnx.NodeProto] = []
    prescale: dict[str, str] = {}
    gate = None
    if fast:
        gate = ungate(graph, binding, state_inputs)  # loss scaling's Where(finite, new, S): see gated_updates
        cut_nodes, prescale = cuttable_nodes(graph, binding, state_inputs)
        if gate is not None:
            regate(graph, binding, gate, cut_nodes)
            gate = gate if gate.wheres else None
            bound_values = set(binding.values())
    groups = row_groups(graph, binding, state_inputs,
                        {i for n in cut_nodes for i in n.input}) if fast else []
    taken = {i for n in cut_nodes for i in n.input} | {s for g in groups for s in g.states}
    rms = rmsprop_groups(graph, binding, state, meta, taken) if fast else []
    row_nodes = [n for g in groups for n in g.nodes] + [n for g in rms for n in g.nodes]
    cut_outputs = {o for n in cut_nodes + row_nodes for o in n.output if o}
    remove_nodes(graph, cut_nodes + row_nodes)

    # what the graph onnxruntime runs must output
    sources, extra_outputs = cut_sources(cut_nodes, graph, state, rate_inputs, init_values, input_types,
                                         prescale,
                                         arrays)
    if gate is not None:  # the cut updates land only where the flag is true
        sources[gate.flag] = FromOutput(gate.flag)
        extra_outputs.append(gate.flag)
    reads = onnx.helper.make_node("Identity", list(dict.fromkeys(r for g in groups for r in g.reads)), [])
    row_sources, dynamic = cut_sources([reads], graph, state, rate_inputs, init_values, input_types,
                                  arrays=arrays)
    reads = onnx.helper.make_node("Identity", list(dict.fromkeys(r for g in rms for r in g.reads)), [])
    rms_sources, rms_outputs = cut_sources([reads], graph, state, rate_inputs, init_values, input_types,
                                  arrays=arrays)
    # a lazy table's rows and gradient rows change shape with the batch (or the touched rows)
    varying = {r for g in rms if g.rows for r in g.reads[1:]}
    extra_outputs += [name for name in rms_outputs if name not in extra_outputs and name not in varying]
    dynamic += [name for name in rms_outputs if name in varying and name not in dynamic]
    old_outputs = list(graph.output)
    del graph.output[:]
    graph.output.extend(o for o in old_outputs if o.name not in cut_outputs)
    present = {o.name for o in graph.output}
    for name in extra_outputs:
        if name not in present:
            graph.output.append(onnx.ValueInfoProto(name=name))
            present.add(name)

    if not graph.node:  # everything was cut: onnxruntime rejects a graph without nodes
        keepalive = "onnx_training_ops.keepalive"
        zero = onnx.helper.make_tensor("v", onnx.TensorProto.INT64, [], [0])
        graph.node.append(onnx.helper.make_node("Constant", [], [keepalive], value=zero))
        graph.output.append(onnx.ValueInfoProto(name=keepalive))

    returned = [o.name for o in old_outputs if o.name not in bound_values]
    dynamic = [name for name in dynamic if name not in present]
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in dynamic)
    fixed_outputs = [o.name for o in graph.output if o.name not in returned and o.name not in dynamic]
    if groups or rms:  # what only fed the cut updates (their constants, shapes) is dead now
        prune_dead_nodes(graph)

    graph_model = source.with_proto(combined)
    cut = CutNodes(cut_nodes, sources, prescale, gate.flag if gate is not None else None)
    analysis = Analysis(
        index=index, where=where, state_inputs=tuple(state_inputs), binding=binding, rate_inputs=rate_inputs,
        rate_defaults=rate_defaults, input_defaults=program_defaults, returned=tuple(returned),
        loss_names=tuple(loss_names(graph, returned, meta)), fixed_outputs=tuple(fixed_outputs),
        dynamic_outputs=tuple(dynamic), cut_outputs=frozenset(cut_outputs), cut=cut,
        updates=(cut, RowUpdates(groups, row_sources), RMSPropUpdates(rms, rms_sources)),
    )
    return graph_model, analysis


def program_feeds(program: Program) -> tuple[list[FeedSpec], list[FeedSpec]]:
    """(required, optional) inputs of a program: learning rates and inputs with a default are optional."""
    rates = [FeedSpec(name, buf.dtype, buf.shape) for name, buf in program.analysis.rate_inputs.items()]
    return list(program.feeds), [*rates, *(spec for spec, _ in program.optional_feeds)]
