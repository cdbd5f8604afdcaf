"""Sparse gradients of embedding tables and lazy / sparse optimizer updates.

``build_training_model(..., sparse_updates={"emb.*": "lazy"})`` picks an update mode per
trainable (keys are names or :mod:`fnmatch` patterns, the first matching key wins):

``"dense"``
    today's semantics (the ONNX spec): the Gradient of a ``Gather`` is a table-sized
    ScatterND of zeros and the optimizer rewrites every row.
``"lazy"``
    torch ``SparseAdam`` / mxRec ``lazy_adam``: only the looked-up rows change — their X, V
    and H; every other row keeps its parameters *and* its moments. The graph: ``Gather`` the
    touched rows of X, V, H -> the domain's optimizer op on the row slices -> ``ScatterND``
    back into X, V, H.
``"sparse"``
    TensorFlow's ``Adam._apply_sparse_shared`` (``tensorflow/python/training/adam.py``):
    ``m = beta1 * m`` and ``v = beta2 * v`` on *every* row, then ``scatter_add`` of
    ``(1-beta1) * g`` and ``(1-beta2) * g*g`` on the looked-up rows, then
    ``var -= lr_t * m / (sqrt(v) + eps)`` on every row. That is Adam on the whole table with
    the gradient scattered into zeros — dense work. Weight decay (``norm_coefficient``) joins
    only the looked-up rows' gradients, as TF's sparse apply sees only ``grad.values``.
    TensorFlow's ``sparse_apply_adagrad``, ``sparse_apply_momentum`` and ``sparse_apply_rms_prop``
    touch only the looked-up rows, so for Adagrad, Momentum and RMSProp ``"sparse"`` is ``"lazy"``.

A table qualifies when every node reading it is a ``Gather`` on axis 0 taking it as data.
The Gradient node then differentiates with respect to the ``Gather`` outputs instead of the
table, and :func:`gradient_rows` turns those into (unique indices, summed rows):
duplicates are summed (``Unique`` + ``ScatterND(reduction="add")``) as TF's
``_deduplicate_indexed_slices`` and torch's ``coalesce()`` do before their sparse applies.

Exactness notes. Adagrad (no weight decay) is exact by construction: an untouched row has a
zero gradient, and ``H + 0*0 = H``, ``X - rate*0/(sqrt(H)+eps) = X``, so lazy and dense
Adagrad give the same bits. Adam's T is global: the step count of the model, which is the
per-parameter ``state["step"]`` of torch's ``SparseAdam`` whenever the table gets a gradient
every step (it does here: the lookup is in every step's graph) — bias correction is per
parameter, not per row, in both. Momentum's first-step rule (``beta`` not applied at T = 0)
is global too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from ..errors import TrainingOpError
from ..walk import all_graphs, subgraphs
from .emit_update import emit_update
from .ops import Ops

MODES = ("dense", "lazy", "sparse")


@dataclass
class Table:
    """A trainable updated by rows: its name, mode, shape, and the (indices, output) of each Gather reading it."""

    name: str
    mode: str
    dims: tuple[int, ...]
    dtype: np.dtype
    lookups: list[tuple[str, str]] = field(default_factory=list)
    padding: int | None = None  # nn.Embedding's padding_idx (.padding_rows): its lookups leave that row alone


def resolve_modes(option: Mapping[str, str] | None, names: Sequence[str]) -> dict[str, str]:
    """{trainable: mode} for the trainables ``option`` does not leave dense."""
    if option is None:
        return {}
    if not isinstance(option, Mapping):
        raise TrainingOpError("sparse_updates must map trainable names or glob patterns to "
                              f"{' / '.join(MODES)}, found {type(option).__name__}")
    for key, mode in option.items():
        if mode not in MODES:
            raise TrainingOpError(f"sparse_updates[{key!r}] must be one of {MODES}, found {mode!r}")
        if not any(fnmatch.fnmatchcase(n, key) for n in names):
            raise TrainingOpError(f"sparse_updates: {key!r} matches no trainable; trainables: "
                                  f"{', '.join(names)}")
    modes = {}
    for name in names:
        mode = next((m for k, m in option.items() if fnmatch.fnmatchcase(name, k)), "dense")
        if mode != "dense":
            modes[name] = mode
    return modes


def _readers(nodes: Sequence[onnx.NodeProto], name: str) -> list[onnx.NodeProto]:
    found = []
    for node in nodes:
        if name in node.input or any(name in n.input for sub in subgraphs(node)
                                     for g in all_graphs(sub) for n in g.node):
            found.append(node)
    return found


def find_tables(modes: Mapping[str, str], params: Sequence[onnx.TensorProto],
                all_nodes: Sequence[onnx.NodeProto], forward: Sequence[onnx.NodeProto]) -> list[Table]:
    """The tables of ``modes``; raise unless every reader (in ``all_nodes``) is an axis-0
    Gather. The lookups are the Gathers of ``forward`` (the pass the loss reads)."""
    tables = []
    for p in params:
        mode = modes.get(p.name)
        if mode is None:
            continue
        for node in _readers(all_nodes, p.name):
            axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
            if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or \
                    list(node.input).count(p.name) != 1 or node.input[0] != p.name or \
                    axis not in (0, -len(p.dims)):
                raise TrainingOpError(
                    f"sparse_updates: {p.name!r} ({mode}) must be read only by Gather nodes on axis 0 "
                    f"(embedding lookups); node {node.name or node.op_type!r} ({node.op_type}) reads it")
        lookups = [(n.input[1], n.output[0]) for n in forward
                   if n.op_type == "Gather" and n.input and n.input[0] == p.name]
        if not lookups:
            raise TrainingOpError(f"sparse_updates: no Gather of {p.name!r} in the forward pass")
        tables.append(Table(p.name, mode, tuple(int(d) for d in p.dims),
                            helper.tensor_dtype_to_np_dtype(p.data_type), lookups))
    return tables


def lookup_rows(ops: Ops, table: Table, grads: Sequence[str]) -> tuple[str, str]:
    """(row index int64 [M], gradient row [M, *row]) of every lookup of the table, in the order
    of its Gathers; negative indices count from the end, as Gather reads them."""
    rows, n = list(table.dims[1:]), table.dims[0]
    flat = ops.const(np.array([-1], np.int64))
    row_shape = ops.const(np.array([-1, *rows], np.int64))
    idx = [ops.op("Reshape", [ops.op("Cast", [i], to=onnx.TensorProto.INT64), flat])
           for i, _ in table.lookups]
    g = [ops.op("Reshape", [gi, row_shape]) for gi in grads]
    idx = idx[0] if len(idx) == 1 else ops.op("Concat", idx, axis=0)
    g = g[0] if len(g) == 1 else ops.op("Concat", g, axis=0)
    zero = ops.const(np.array(0, np.int64))
    idx = ops.op("Where", [ops.op("Less", [idx, zero]),
                           ops.op("Add", [idx, ops.const(np.array(n, np.int64))]), idx])
    return idx, g


def gradient_rows(ops: Ops, table: Table, grads: Sequence[str]) -> tuple[str, str]:
    """(unique indices int64 [U], summed gradient rows [U, *row]) from the gradients of the
    table's Gather outputs (:func:`lookup_rows`), duplicates added in order from zero."""
    idx, g = lookup_rows(ops, table, grads)
    unique, _, inverse, _ = ops.op("Unique", [idx], n_out=4, sorted=1)
    shape = ops.op("Concat", [ops.op("Shape", [unique]), ops.const(np.array(table.dims[1:], np.int64))],
                   axis=0)
    zeros = ops.op("ConstantOfShape", [shape], value=helper.make_tensor(
        "zero", helper.np_dtype_to_tensor_dtype(table.dtype), [1], [0]))
    at = ops.op("Unsqueeze", [inverse, ops.const(np.array([1], np.int64))])
    return unique, ops.op("ScatterND", [zeros, at, g], reduction="add")


def find_gradient_rows(nodes: Sequence[onnx.NodeProto], grads: Sequence[str]) -> tuple[str, str] | None:
    """The (unique indices, summed rows) :func:`gradient_rows` made from ``grads`` in ``nodes``:
    the first ``ScatterND(reduction="add")`` whose updates come from ``grads`` and whose
    indices are ``Unsqueeze`` of a ``Unique``'s inverse; None when no node reads ``grads``."""
    if not any(i in grads for n in nodes for i in n.input):
        return None
    producers = {o: n for n in nodes for o in n.output if o}
    reached = set(grads)
    for node in nodes:
        if not any(i in reached for i in node.input):
            continue
        reduction = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "reduction"), b"")
        at = producers.get(node.input[1]) if node.op_type == "ScatterND" and len(node.input) == 3 else None
        unique = producers.get(at.input[0]) if at is not None and at.op_type == "Unsqueeze" else None
        if reduction in (b"add", "add") and node.input[2] in reached and node.input[0] not in reached \
                and at is not None and unique is not None and unique.op_type == "Unique" \
                and len(unique.output) > 2 and unique.output[2] == at.input[0]:
            return unique.output[0], node.output[0]
        reached.update(o for o in node.output if o)
    raise TrainingOpError(f"the gradients {', '.join(grads)} of a sparse table's lookups do not reach "
                          "a Unique + ScatterND(reduction='add') deduplication (the builder's "
                          "gradient_rows); cannot split this model into backward/apply stages")


def emit_table_update(ops: Ops, optimizer, table: Table, r: str, t: str, unique: str, rows: str,
                      states: Mapping[str, str], new_x: str, new_states: Mapping[str, str]) -> None:
    """The table's update in its mode, writing ``new_x`` and ``new_states``."""
    at = ops.op("Unsqueeze", [unique, ops.const(np.array([1], np.int64))])
    if table.mode == "sparse" and optimizer.op_type == "Adam":
        decay = optimizer.attributes()["norm_coefficient"]
        if decay:
            x_rows = ops.op("Gather", [table.name, unique], axis=0)
            rows = ops.op("Add", [rows, ops.op("Mul", [ops.const(np.array(decay, table.dtype)), x_rows])])
        zeros = ops.op("ConstantOfShape", [ops.const(np.array(table.dims, np.int64))],
                       value=helper.make_tensor("zero", helper.np_dtype_to_tensor_dtype(table.dtype), [1], [0]))
        grad = ops.op("ScatterND", [zeros, at, rows])
        emit_update(ops, optimizer, r, t, [table.name], [grad], {s: [v] for s, v in states.items()},
                    [new_x], {s: [v] for s, v in new_states.items()}, [table.dtype],
                    attributes={"norm_coefficient": 0.0})
        return
    x_rows = ops.op("Gather", [table.name, unique], axis=0)
    s_rows = {s: ops.op("Gather", [v, unique], axis=0) for s, v in states.items()}
    x_new = ops.unique(f"{table.name}.rows.new")
    s_new = {s: ops.unique(f"{table.name}.{s}.rows.new") for s in states}
    emit_update(ops, optimizer, r, t, [x_rows], [rows], {s: [v] for s, v in s_rows.items()},
                [x_new], {s: [v] for s, v in s_new.items()}, [table.dtype])
    ops.op("ScatterND", [table.name, at, x_new], out=new_x)
    for s, v in states.items():
        ops.op("ScatterND", [v, at, s_new[s]], out=new_states[s])
