"""The stages of a training step, cut out of the model's one algorithm: evaluate, backward, apply.

A training model's algorithm (``training_info[0]``) reads as forward -> loss -> ``Gradient``
-> (clipping, decay) -> optimizer nodes. The stages are derived from it, so the model stays
the one spec-valid, self-describing file and a ``step`` stays one onnxruntime run; the
convention is the ``Gradient`` node's outputs, where a step splits:

* **evaluate**: the eval-mode loss (the builder's ``eval_loss``, else the loss) and any
  requested values, no state written;
* **backward**: everything up to the Gradient node's outputs; each gradient ``G`` is added
  into an accumulator ``G.accumulated`` (times the feed ``grad_scale``), and state updated
  outside the optimizer (BatchNorm running statistics) is updated as in a step;
* **apply**: what the optimizer does with the gradients, reading the accumulators instead:
  clipping, weight decay, the optimizer nodes and ``T <- T + 1``.

A sparse table (:mod:`onnx_training_ops.builder.sparse_updates`) is differentiated at its lookups
(the ``Gather`` outputs, batch-shaped), so its accumulators are table-sized: *backward*
scatter-adds ``grad_scale`` times each lookup's gradient rows into ``E.grad.accumulated`` and 1
into the per-row counter ``E.grad.touched`` (same dtype); *apply* takes the rows whose counter is
positive (ascending) and their accumulated rows in place of :func:`gradient_rows`'s
(unique indices, summed rows). Both are dense sums, so scaling or an all-reduce (sum, then
× 1/world) keeps them meaningful: a row touched anywhere is updated, as torch's
``SparseAdam`` does with accumulated gradients, even when its summed gradient is zero.

A binding belongs to *apply* when its new value depends on a gradient or feeds an optimizer
node, its state is an optimizer input (X, V, H, T), or its new value depends on no feed (a
counter such as T: once per optimizer step); every other binding — state computed from the
batch, like BatchNorm running statistics — to *backward*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...autodiff.rules_shape import padding_row
from ...builder.metadata import TrainingMetadata
from ...builder.ops import Ops
from ...builder.sparse_updates import Table, find_gradient_rows, lookup_rows
from ...errors import TrainingOpError
from ...passes._graph import value_types
from ...schema import DOMAIN, OPTIMIZERS
from ...storage.tensors import constant_array, set_location
from .pruning import node_reads

GRAD_SCALE = "onnx_training_ops.grad_scale"


@dataclass
class Stages:
    """The derived models and their accumulators: ``accumulators`` (dense gradient name ->
    (accumulator, parameter)) and ``tables`` (sparse table -> (accumulator, touched counter))."""

    backward: onnx.ModelProto
    apply: onnx.ModelProto
    accumulators: dict[str, tuple[str, str]]
    tables: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def gradients(self) -> dict[str, str]:
        """Parameter -> the accumulator of its gradient (a table's is table-sized)."""
        return {**{x: acc for acc, x in self.accumulators.values()},
                **{x: acc for x, (acc, _) in self.tables.items()}}

    @property
    def views(self) -> list[tuple[str, str]]:
        """(parameter, accumulator state) of every accumulator, counters included, in layout
        order: the dense gradients, then per table its accumulator and its touched counter."""
        return [*((x, acc) for acc, x in self.accumulators.values()),
                *((x, name) for x, pair in self.tables.items() for name in pair)]

    @property
    def buffers(self) -> list[str]:
        """Every accumulator state, counters included (what ``zero_grad`` zeroes)."""
        return [name for _, name in self.views]


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    derived = onnx.ModelProto()
    derived.CopyFrom(model)
    return derived


def _gradient_nodes(algo: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in algo.node if n.domain == DOMAIN and n.op_type == "Gradient"]


def _descendants(nodes, sources: set[str]) -> set[str]:
    """Every value computed from ``sources`` (nodes in topological order)."""
    reached = set(sources)
    for node in nodes:
        if any(name in reached for name in node_reads(node)):
            reached.update(o for o in node.output if o)
    return reached


def typed_values(model: onnx.ModelProto, names: Sequence[str], what: str) -> list[onnx.ValueInfoProto]:
    """A value info for each of ``names``: a value of the main graph (an output, or an inner
    value whose type shape inference knows) or of the first algorithm graph; else an error
    naming ``what`` asked for it."""
    graphs = [model.graph] + [model.training_info[0].algorithm] if model.training_info else [model.graph]
    known = {vi.name: vi for g in graphs for vi in (*g.value_info, *g.output)}
    types = None
    out = []
    for name in dict.fromkeys(names):
        if name not in known:
            types = value_types(model) if types is None else types
            vt = types.get(name)
            if vt is None or not vt.elem_type:
                raise TrainingOpError(
                    f"{what}: {name!r} is not a value of the model with a known type; outputs: "
                    f"{', '.join(o.name for o in model.graph.output)}")
            known[name] = helper.make_tensor_value_info(name, vt.elem_type, None)
        out.append(known[name])
    return out


def evaluation_model(model: onnx.ModelProto, loss: str, outputs: list[str]) -> onnx.ModelProto:
    """The model whose algorithm outputs ``loss`` and ``outputs`` and binds nothing.
    ``outputs`` may name any value of the main graph (an output, or an inner value whose
    type shape inference knows) or an output of the algorithm."""
    derived = _copy(model)
    info = derived.training_info[0]
    values = typed_values(model, [loss, *outputs], "evaluate")
    del info.update_binding[:]
    del info.algorithm.output[:]
    info.algorithm.output.extend(values)
    return derived


def session_evaluation(model: onnx.ModelProto, meta: TrainingMetadata, outputs: Sequence[str]) -> onnx.ModelProto:
    """What a session's ``evaluate(outputs=...)`` runs: :func:`evaluation_model` of the builder's
    eval-mode loss (else its loss), or of ``outputs`` alone for a model that names no loss."""
    loss = meta.evaluation_loss
    if not loss and not outputs:
        raise TrainingOpError("evaluate: the model names no loss (metadata 'loss'); pass outputs=[...]")
    if loss:
        return evaluation_model(model, loss, list(outputs))
    return evaluation_model(model, outputs[0], list(outputs[1:]))


def step_model(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """The model whose first algorithm also outputs ``outputs`` (values of the same run, as
    onnxruntime-training's ``additional_output_names``); its bindings unchanged."""
    derived = _copy(model)
    algorithm = derived.training_info[0].algorithm
    present = {o.name for o in algorithm.output}
    algorithm.output.extend(vi for vi in typed_values(model, outputs, "step(outputs=...)")
                            if vi.name not in present)
    return derived


def _gradients(model: onnx.ModelProto) -> dict[str, str]:
    """Each gradient the algorithm's Gradient nodes output -> its x (a model with one
    training_info and a Gradient node, else a TrainingOpError)."""
    if len(model.training_info) != 1:
        raise TrainingOpError(f"backward/optimizer_step need a model with one training_info, "
                              f"found {len(model.training_info)}")
    gradient_nodes = _gradient_nodes(model.training_info[0].algorithm)
    if not gradient_nodes:
        raise TrainingOpError("backward/optimizer_step need a Gradient node in the algorithm "
                              "(where a step splits into backward and apply); this model has none")
    grads: dict[str, str] = {}
    for node in gradient_nodes:
        xs = [x.decode() for a in node.attribute if a.name == "xs" for x in a.strings]
        grads.update(zip(node.output, xs))
    return grads


def split_stages(model: onnx.ModelProto, arrays: dict | None = None) -> Stages:
    """The backward and apply models of ``model`` (see the module doc). With ``arrays`` (a
    large model's) the dense accumulators' zeros stay out of the messages: constant arrays
    added to ``arrays`` under ``#<name>`` (they take no memory)."""
    grads = _gradients(model)
    info = model.training_info[0]
    algo = info.algorithm
    nodes = [*model.graph.node, *algo.node]
    params = {t.name: t for t in (*model.graph.initializer, *algo.initializer)}
    tables = _sparse_tables(nodes, grads, params)
    looked_up = {g for _, gs in tables.values() for g in gs}
    dense = {g: x for g, x in grads.items() if g not in looked_up}
    from_grads = _descendants(nodes, set(grads))
    optimizer_inputs = {i for n in algo.node if n.domain == DOMAIN and n.op_type in OPTIMIZERS
                        for i in n.input}
    inits = set(params)
    feeds = {i.name for i in (*model.graph.input, *algo.input) if i.name not in inits}
    from_feeds = _descendants(nodes, feeds)
    # apply: what the gradients or an optimizer make, and counters the batch does not touch (T)
    applied = [e for e in info.update_binding
               if e.value in from_grads or e.value in optimizer_inputs or e.key in optimizer_inputs
               or e.value not in from_feeds]
    kept = [e for e in info.update_binding if e not in applied]
    outputs = {o.name: o for o in algo.output}
    bound = {e.value for e in info.update_binding}
    types = {g: (params[x].data_type, list(params[x].dims)) for g, x in dense.items()}
    taken = {o for n in nodes for o in n.output} | inits | \
        {i.name for i in (*model.graph.input, *algo.input)}

    def unique(base: str) -> str:
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}.{k}"
        taken.add(name)
        return name

    accumulators = {g: (unique(f"{g}.accumulated"), x) for g, x in dense.items()}
    table_accs = {x: (unique(f"{x}.grad.accumulated"), unique(f"{x}.grad.touched")) for x in tables}

    backward = _copy(model)
    b_info = backward.training_info[0]
    b_algo = b_info.algorithm
    del b_info.update_binding[:]
    b_info.update_binding.extend(kept)
    del b_algo.output[:]
    b_algo.output.extend(o for o in algo.output if o.name not in bound and o.name not in from_grads)
    b_algo.output.extend(outputs[e.value] for e in kept if e.value in outputs)
    b_algo.input.append(helper.make_tensor_value_info(GRAD_SCALE, TensorProto.DOUBLE, []))
    for g, (acc, _) in accumulators.items():
        elem, dims = types[g]
        scale, scaled, new = unique(f"{g}.scale"), unique(f"{g}.scaled"), unique(f"{acc}.new")
        b_algo.initializer.append(_zeros(acc, elem, dims, arrays))
        b_algo.node.extend([
            helper.make_node("Cast", [GRAD_SCALE], [scale], to=elem, name=scale),
            helper.make_node("Mul", [g, scale], [scaled], name=scaled),
            helper.make_node("Add", [acc, scaled], [new], name=new),
        ])
        b_algo.output.append(helper.make_tensor_value_info(new, elem, dims))
        b_info.update_binding.add(key=acc, value=new)
    for x, (table, gs) in tables.items():
        zeros = _table_zeros(table, *table_accs[x])
        accumulated = _accumulate_rows(Ops(unique, b_algo.node, f"{x}.grad.accumulate"), table, gs, *table_accs[x])
        b_algo.initializer.extend(zeros)
        for state, value in zip(zeros, accumulated):
            b_algo.output.append(helper.make_tensor_value_info(value, state.data_type, list(state.dims)))
            b_info.update_binding.add(key=state.name, value=value)

    apply = _copy(model)
    a_info = apply.training_info[0]
    a_algo = a_info.algorithm
    del a_info.update_binding[:]
    a_info.update_binding.extend(applied)
    rename = {g: acc for g, (acc, _) in accumulators.items()}
    a_nodes = [n for n in a_algo.node if not (n.domain == DOMAIN and n.op_type == "Gradient")]
    touched_rows: list[onnx.NodeProto] = []
    for x, (table, gs) in tables.items():
        rows = find_gradient_rows(a_nodes, gs)
        if rows is None:  # nothing here updates the table (another rank's, with a sharded optimizer)
            continue
        rename.update(zip(rows, _touched_rows(Ops(unique, touched_rows, f"{x}.grad.rows"), table, *table_accs[x])))
    for node in a_nodes:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    # what only the lookups' gradients made (the deduplication, replaced by touched_rows)
    dead = _descendants(a_nodes, looked_up)
    a_nodes = [*touched_rows, *(n for n in a_nodes if not any(i in dead for i in node_reads(n)))]
    del a_algo.node[:]
    a_algo.node.extend(a_nodes)
    for g, (acc, _) in accumulators.items():
        elem, dims = types[g]
        a_algo.initializer.append(_zeros(acc, elem, dims, arrays))
    for x, (table, _) in tables.items():
        a_algo.initializer.extend(_table_zeros(table, *table_accs[x]))
    del a_algo.output[:]
    a_algo.output.extend(o for o in algo.output if o.name not in bound and o.name in from_grads)
    a_algo.output.extend(outputs[e.value] for e in applied if e.value in outputs)
    lost = [name for name in (*(o.name for o in a_algo.output), *(e.value for e in applied)) if name in dead]
    if lost:
        raise TrainingOpError(f"optimizer_step: {lost[0]!r} is computed from the lookup gradients of "
                              f"sparse table(s) {', '.join(tables)} other than through their deduplicated "
                              "rows; the apply stage cannot compute it from the accumulated table gradient")
    return Stages(backward, apply, accumulators, table_accs)


def _sparse_tables(nodes: Sequence[onnx.NodeProto], grads: dict[str, str],
                   params: dict[str, onnx.TensorProto]) -> dict[str, tuple[Table, list[str]]]:
    """The sparse tables among the Gradient node's xs: an x that is no initializer must be an
    axis-0 ``Gather`` of one (a lookup). Table -> (its lookups, their gradients, in xs order)."""
    producers = {o: n for n in nodes for o in n.output if o}
    tables: dict[str, tuple[Table, list[str]]] = {}
    for g, x in grads.items():
        if x in params:
            continue
        gather = producers.get(x)
        axis = next((helper.get_attribute_value(a) for a in gather.attribute if a.name == "axis"), 0) \
            if gather is not None else None
        table = params.get(gather.input[0]) if gather is not None and gather.op_type == "Gather" \
            and gather.domain in ("", "ai.onnx") else None
        if gather is None or table is None or axis not in (0, -len(table.dims)):
            found = f"{gather.op_type} node {gather.name!r}" if gather is not None else "no node"
            raise TrainingOpError(f"backward: the Gradient node's x {x!r} is neither an initializer nor "
                                  f"an axis-0 Gather of one (a sparse table's lookup); it comes from {found}")
        if table.name not in tables:
            dtype = helper.tensor_dtype_to_np_dtype(table.data_type)  # (its mode is the apply graph's)
            tables[table.name] = (Table(table.name, "", tuple(int(d) for d in table.dims), dtype), [])
        tables[table.name][0].lookups.append((gather.input[1], x))
        if padding_row(gather) is not None:  # nn.Embedding(padding_idx=...) (builder.padding_rows)
            tables[table.name][0].padding = padding_row(gather)
        tables[table.name][1].append(g)
    return tables


def _accumulate_rows(ops: Ops, table: Table, grads: Sequence[str], acc: str, touched: str) -> tuple[str, str]:
    """Backward of a sparse table: ``acc[i] += grad_scale * g`` and ``touched[i] += 1`` for each
    looked-up row ``i`` (duplicates added in order) but the table's padding row, which its
    lookups leave alone, as torch's sparse embedding gradient; returns the new (acc, touched)."""
    idx, g = lookup_rows(ops, table, grads)
    at = ops.op("Unsqueeze", [idx, ops.const(np.array([1], np.int64))])
    elem = helper.np_dtype_to_tensor_dtype(table.dtype)
    scaled = ops.op("Mul", [g, ops.op("Cast", [GRAD_SCALE], to=elem)])
    ones = ops.op("ConstantOfShape", [ops.op("Shape", [idx])],
                  value=numpy_helper.from_array(np.ones(1, table.dtype)))
    if table.padding is not None:
        is_pad = ops.op("Equal", [idx, ops.const(np.array(table.padding, np.int64))])
        zero = ops.const(np.zeros((), table.dtype))
        ones = ops.op("Where", [is_pad, zero, ones])
        if len(table.dims) > 1:
            is_pad = ops.op("Unsqueeze", [is_pad, ops.const(np.arange(1, len(table.dims), dtype=np.int64))])
        scaled = ops.op("Where", [is_pad, zero, scaled])
    return (ops.op("ScatterND", [acc, at, scaled], reduction="add"),
            ops.op("ScatterND", [touched, at, ones], reduction="add"))


def _touched_rows(ops: Ops, table: Table, acc: str, touched: str) -> tuple[str, str]:
    """Apply of a sparse table: (the rows whose counter is positive, int64 ascending; their
    accumulated gradient rows), in place of the deduplicated (unique indices, summed rows)."""
    positive = ops.op("Greater", [touched, ops.const(np.zeros((), table.dtype))])
    rows = ops.op("Reshape", [ops.op("NonZero", [positive]), ops.const(np.array([-1], np.int64))])
    return rows, ops.op("Gather", [acc, rows], axis=0)


def _table_zeros(table: Table, acc: str, touched: str) -> list[onnx.TensorProto]:
    """A sparse table's accumulator [rows, ...] and touched counter [rows], zero, in its dtype."""
    return [numpy_helper.from_array(np.zeros(table.dims, table.dtype), acc),
            numpy_helper.from_array(np.zeros(table.dims[:1], table.dtype), touched)]


def _zeros(name: str, elem: int, dims: list[int], arrays: dict | None = None) -> onnx.TensorProto:
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    if arrays is None:
        return numpy_helper.from_array(np.zeros(dims, dtype), name)
    tensor = onnx.TensorProto(name=name, data_type=elem)
    tensor.dims.extend(dims)
    set_location(tensor, f"#{name}")
    arrays[f"#{name}"] = constant_array(0, dtype, dims)
    return tensor
