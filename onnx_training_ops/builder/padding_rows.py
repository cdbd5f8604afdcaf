"""``nn.Embedding(padding_idx=k)``: the padding row gets no gradient from its lookups, as in torch.

torch's ``embedding_backward`` skips every looked-up position whose index is ``padding_idx``:
the row's gradient *from the lookup* is zero (weight decay still applies to it, and a weight
tied to the embedding, e.g. a language-model head, still gives the row its own gradient).
ONNX's ``Gather`` has no such notion, so the builder restores it:

* **Where the padding row comes from.** torch's default exporter (``dynamo=True``) records each
  node's torch call in ``pkg.torch.onnx.fx_node`` metadata, e.g.
  ``aten.embedding.default(args = (%p_emb_weight, %ids, 0))``: its third argument is the
  padding row (:func:`detect_padding_rows`). The TorchScript exporter (``dynamo=False``) keeps
  nothing of it (its ``Gather`` nodes carry no metadata), so there the caller says it:
  ``build_training_model(..., padding_rows={"embeddings.word_embeddings.weight": 0})``, unless
  the model came from :func:`~onnx_training_ops.export.from_torch.export_for_training`, which records the
  module's ``padding_idx`` values in the model metadata :data:`TORCH_PADDING_KEY`. The
  argument also overrides what was detected (``None`` for a table trains its padding row).
* **How.** Each axis-0 ``Gather`` of the table in the forward pass the loss reads is marked
  with the node metadata ``onnx_training_ops.padding_idx`` (:func:`mark_lookups`; onnxruntime
  ignores node metadata). The ``Gather`` derivative rule (:mod:`..autodiff.rules_shape`) reads
  it and zeroes the output gradient at the padding positions before scattering it into the
  table, torch's ``embedding_backward`` exactly: the row's gradient from other readers of the
  table (a tied head) stays. Tables updated by rows (``sparse_updates``, differentiated at their
  lookups) get the same mask on their lookups' gradients (:func:`mask_lookup`); the row is then
  still "touched", with a zero gradient, so without weight decay it never moves.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from ..autodiff.rules_shape import PADDING_ROW_KEY
from ..errors import TrainingOpError
from ..walk import all_graphs, subgraphs
from .dynamo_params import FX_NODE_KEY, exported_parameters
from .ops import Ops

TORCH_PADDING_KEY = "torch.padding_idx"  # {initializer: row}, by export_for_training (outside the builder's prefix)
_EMBEDDING = re.compile(r"^%\w+ : .*?call_function\[target=torch\.ops\.aten\.embedding\.\w+\]"
                        r"\(args = \((.*)\), kwargs = \{(.*)\}\)\s*$", re.S)


def recorded_padding_rows(model: onnx.ModelProto) -> dict[str, int]:
    """{initializer: padding_idx} that :func:`~onnx_training_ops.export.from_torch.export_for_training`
    recorded under :data:`TORCH_PADDING_KEY`; {} when there is none.

    Raises:
        TrainingOpError: the entry is not a JSON object of integer rows.
    """
    text = next((m.value for m in model.metadata_props if m.key == TORCH_PADDING_KEY), None)
    if text is None:
        return {}
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise TrainingOpError(f"model metadata {TORCH_PADDING_KEY!r} is not JSON: {error}") from None
    if not isinstance(rows, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in rows.values()):
        raise TrainingOpError(f"model metadata {TORCH_PADDING_KEY!r} must map initializer names to integer rows, "
                              f"found {text[:100]!r}")
    return rows


def detect_padding_rows(graph: onnx.GraphProto, recorded: Mapping[str, int] | None = None) -> dict[str, int]:
    """{torch parameter name: padding_idx} of every ``aten.embedding`` call with a padding row
    in a dynamo export's ``pkg.torch.onnx.fx_node`` node metadata, over ``recorded`` (what
    :func:`recorded_padding_rows` read); {} for other models.

    Raises:
        TrainingOpError: one table looked up with two different padding rows.
    """
    found: dict[str, int] = dict(recorded or {})
    params = exported_parameters(graph)
    if not params:
        return found
    for node in graph.node:
        fx = next((p.value for p in node.metadata_props if p.key == FX_NODE_KEY), "")
        m = _EMBEDDING.match(fx)
        if not m:
            continue
        args = [a.strip() for a in m.group(1).split(",")]
        kwargs = dict(re.findall(r"(\w+): (-?\d+)", m.group(2)))
        weight = args[0][1:] if args and args[0].startswith("%") else ""
        padding = kwargs.get("padding_idx", args[2] if len(args) > 2 else "-1")
        if weight not in params or not re.fullmatch(r"-?\d+", padding) or int(padding) < 0:
            continue  # no padding row (torch's default -1), or a table that is no parameter
        name = params[weight]
        if found.get(name, int(padding)) % max(1, _rows(graph, name)) != int(padding):
            raise TrainingOpError(f"torch parameter {name!r} is looked up with padding_idx {found[name]} and "
                                  f"{padding} (node {node.name!r}); pass padding_rows={{{name!r}: row}} to "
                                  "choose one")
        found[name] = int(padding)
    return found


def _rows(graph: onnx.GraphProto, name: str) -> int:
    return next((int(t.dims[0]) for t in graph.initializer if t.name == name and t.dims), 0)


def resolve_padding_rows(option: Mapping[str, int | None] | None, detected: Mapping[str, int],
                         model: onnx.ModelProto) -> dict[str, int]:
    """{table: padding row in [0, rows)}: ``detected`` updated by ``option`` (None drops one).

    Raises:
        TrainingOpError: ``option`` is not a mapping, names no initializer of rank >= 1, or
            gives a row that is not an integer within the table's ``[-rows, rows)``.
    """
    if option is not None and not isinstance(option, Mapping):
        raise TrainingOpError("padding_rows must map embedding table names to a row index (or None), found "
                              f"{type(option).__name__}")
    inits = {t.name: t for t in model.graph.initializer}
    rows: dict[str, int | None] = {**detected, **(option or {})}
    out = {}
    for name, row in rows.items():
        table = inits.get(name)
        if table is None or len(table.dims) < 1:
            raise TrainingOpError(f"padding_rows: {name!r} is not an initializer of rank >= 1 of the model "
                                  f"(tables: {', '.join(t.name for t in inits.values() if len(t.dims) == 2)})")
        if row is None:
            continue
        n = int(table.dims[0])
        given: object = row  # from the caller: checked, whatever its annotation says
        if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or not -n <= given < n:
            raise TrainingOpError(f"padding_rows[{name!r}] must be an integer row of its {n} rows "
                                  f"(-{n} <= row < {n}, as torch's padding_idx), found {row!r}")
        out[name] = int(row) % n
    return out


def _is_lookup(node: onnx.NodeProto, table: str, rank: int) -> bool:
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    return node.op_type == "Gather" and node.domain in ("", "ai.onnx") and len(node.input) == 2 \
        and node.input[0] == table and node.input[1] != table and axis in (0, -rank)


def mark_lookups(rows: Mapping[str, int], params: Sequence[onnx.TensorProto],
                 forward: Sequence[onnx.NodeProto], others: Sequence[onnx.NodeProto] = (),
                 given: Collection[str] = ()) -> dict[str, int]:
    """Mark every axis-0 ``Gather`` of a trained table of ``rows`` in ``forward`` (the pass the
    loss reads) and ``others`` (the main graph, when the loss reads a training-mode copy) with
    its padding row (node metadata :data:`PADDING_ROW_KEY`). Returns {table: row} of the
    tables marked.

    Args:
        rows: {table: padding row} (:func:`resolve_padding_rows`).
        params: the trainables (other tables get no gradient anyway).
        forward: the nodes of the pass the loss reads.
        others: more nodes whose lookups get the mark (not required to have any).
        given: the tables the caller named in ``padding_rows`` (the rest were read from the
            export): a table of these that cannot be marked is an error, another a warning.

    Raises:
        TrainingOpError: a table of ``given`` that no axis-0 ``Gather`` of the forward pass
            reads, or one looked up inside a control-flow body.
    """
    marked = {}
    for p in params:
        if p.name not in rows:
            continue
        problem = None
        if not any(_is_lookup(n, p.name, len(p.dims)) for n in forward):
            problem = f"no Gather on axis 0 of {p.name!r} (an embedding lookup) in the forward pass the loss reads"
        body = next((node for node in [*forward, *others] for sub in subgraphs(node) for g in all_graphs(sub)
                     if any(p.name in n.input for n in g.node)), None)
        if body is not None:
            problem = (f"{p.name!r} is read inside the body of {body.op_type} node {body.name!r}; padding rows "
                       "are kept only for lookups in the main graph")
        if problem and p.name in given:
            raise TrainingOpError(f"padding_rows: {problem}")
        if problem:
            warnings.warn(f"torch's padding_idx {rows[p.name]} of {p.name!r} (read from the export) is not kept: "
                          f"{problem}; that row trains", stacklevel=3)
            continue
        for node in [*forward, *others]:
            if _is_lookup(node, p.name, len(p.dims)):
                kept = [m for m in node.metadata_props if m.key != PADDING_ROW_KEY]
                del node.metadata_props[:]
                node.metadata_props.extend(kept)
                node.metadata_props.add(key=PADDING_ROW_KEY, value=str(rows[p.name]))
        marked[p.name] = rows[p.name]
    return marked


def mask_lookup(ops: Ops, ids: str, grad: str, row: int, dims: Sequence[int], dtype) -> str:
    """The gradient ``grad`` [*ids, *row dims] of one lookup ``Gather(table, ids)`` with the
    positions looking up the padding ``row`` zero (negative ids count from the end)."""
    ids = ops.op("Cast", [ids], to=onnx.TensorProto.INT64)
    ids = ops.op("Where", [ops.op("Less", [ids, ops.const(np.array(0, np.int64))]),
                           ops.op("Add", [ids, ops.const(np.array(dims[0], np.int64))]), ids])
    is_pad = ops.op("Equal", [ids, ops.const(np.array(row, np.int64))])
    is_pad = ops.op("Unsqueeze", [is_pad, ops.const(np.arange(1 - len(dims), 0, dtype=np.int64))])
    return ops.op("Where", [is_pad, ops.const(np.zeros((), dtype)), grad])


def to_json(rows: Mapping[str, int]) -> str:
    """The builder's metadata entry ``padding_rows``."""
    return json.dumps(dict(sorted(rows.items())))
