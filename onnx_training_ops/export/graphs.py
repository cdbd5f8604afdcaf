"""The three exported graphs: the training step, evaluation and inference, in standard ONNX ops.

The step is what :class:`~onnx_training_ops.TrainingSession` runs, made portable: the main
graph and the algorithm concatenated (:func:`~onnx_training_ops.training.graphs.program.combined_graph`,
state initializers as inputs), then :func:`~onnx_training_ops.prepare` with ``portable=True``
(Gradient expanded, optimizers lowered to standard ops). What the JavaScript, Java and
Objective-C bindings need on top: **no input with a stored default** (they do not list such an
input, and onnxruntime-node ignores a value fed to it), so each default (the learning rates'
among them) leaves the graph for the manifest; no node of the training domain; the lowest IR
version the opsets allow, for older runtimes; ``onnx.checker`` with ``full_check``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder.metadata import TrainingMetadata
from ..errors import TrainingOpError, node_label
from ..runtime.pipeline import prepare_model
from ..storage.large_model import LargeModel
from ..training.graphs.inference import inference_model
from ..training.graphs.program import combined_graph
from ..training.graphs.pruning import used_names
from ..training.graphs.stages import evaluation_model
from ..walk import all_graphs

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
ONNXRUNTIME_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops: kept where the model itself has them


def domains(model: onnx.ModelProto) -> tuple[str, ...]:
    """The op domains ``model``'s exported graphs may use: ONNX's, and onnxruntime's contrib
    ops (``com.microsoft``) when the model already uses them (onnxruntime-genai's models:
    ``MatMulNBits``, ``GroupQueryAttention``...). Every onnxruntime package has those
    (onnxruntime-node, onnxruntime-web's wasm, the mobile packages), not a minimal build."""
    uses = any(node.domain == ONNXRUNTIME_DOMAIN for g in all_graphs(model.graph) for node in g.node)
    return (*STANDARD_DOMAINS, ONNXRUNTIME_DOMAIN) if uses else STANDARD_DOMAINS


@dataclass
class Graph:
    """An exported graph, the defaults taken out of it (input name -> value), and the arrays
    of its tensors that stay out of its message (``#<key>`` locations, a model past
    protobuf's 2 GB: :data:`~onnx_training_ops.export.writer.EXTERNAL_BYTES`)."""

    model: onnx.ModelProto
    defaults: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def _plain_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Remove every initializer that shares its name with a graph input (returns their
    values), and those no node reads."""
    graph = model.graph
    inputs = {vi.name for vi in graph.input}
    defaults = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name in inputs}
    read = used_names(graph)
    kept = [t for t in graph.initializer if t.name not in defaults and t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return defaults


def _drop_contradicted_shapes(model: onnx.ModelProto) -> None:
    """Remove the ``value_info`` of Constant outputs whose declared rank is not the constant's
    (onnxruntime-genai's builder declares its ``[1]`` constants as scalars): the full checker
    would refuse the exported graph for a hint."""
    for graph in all_graphs(model.graph):
        ranks = {node.output[0]: len(attr.t.dims) for node in graph.node if node.op_type == "Constant"
                 and node.domain in ("", "ai.onnx") for attr in node.attribute if attr.name == "value"}
        wrong = {vi.name for vi in graph.value_info if vi.name in ranks and vi.type.tensor_type.HasField("shape")
                 and len(vi.type.tensor_type.shape.dim) != ranks[vi.name]}
        if wrong:
            kept = [vi for vi in graph.value_info if vi.name not in wrong]
            del graph.value_info[:]
            graph.value_info.extend(kept)


def _standard(model: onnx.ModelProto, what: str, check: bool = True,
              allowed: Sequence[str] = STANDARD_DOMAINS) -> onnx.ModelProto:
    """Check that ``model`` uses standard ops only (and those of the ``allowed`` domains,
    :func:`domains`), drop other opset imports, set the lowest IR version its opsets allow,
    and run the full checker (``check``: a model whose tensors live in a file not yet written
    is checked once written, :func:`check_file`)."""
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.domain not in allowed:
                raise TrainingOpError(f"{what}: {node_label(node)} is in domain {node.domain!r}, not a "
                                      "standard ONNX op; the exported graphs must run in any onnxruntime")
    _drop_contradicted_shapes(model)
    kept = [o for o in model.opset_import if o.domain in allowed]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    model.ir_version = max(helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True), 7)
    if not check:
        return model
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise TrainingOpError(f"{what}: the exported graph fails onnx.checker: "
                              f"{str(error).splitlines()[0]}") from error
    return model


def short_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """Name every inner value ``t<i>`` and drop node names (in place): the expanded gradient's
    descriptive names would take most of the step file; the main graph's inputs, outputs and
    initializers (the weights) keep theirs."""
    graph = model.graph
    keep = {vi.name for vi in (*graph.input, *graph.output)} | {t.name for t in graph.initializer} | {""}
    mapping: dict[str, str] = {}

    def short(name: str) -> str:
        if name in keep:
            return name
        return mapping.setdefault(name, f"t{len(mapping)}")

    for sub in all_graphs(graph):
        for node in sub.node:
            node.name = ""
            node.doc_string = ""
            node.input[:] = [short(n) for n in node.input]
            node.output[:] = [short(n) for n in node.output]
        for collection in (sub.input, sub.output, sub.value_info):
            for vi in collection:
                vi.name = short(vi.name)
        for tensor in sub.initializer:
            tensor.name = short(tensor.name)
        for sparse in sub.sparse_initializer:
            sparse.values.name = short(sparse.values.name)
    return model


def _prepared(model: onnx.ModelProto, flat: bool = False, arrays: Mapping[str, np.ndarray] | None = None,
              ) -> LargeModel:
    """The portable form of ``model``: every tensor in its message, whatever its size, or
    those of ``arrays`` (detached, ``#<key>``) left out of it."""
    return prepare_model(LargeModel(model, arrays, large=bool(arrays)), portable=True, flat=flat)


def _graph(portable: LargeModel, what: str, allowed: Sequence[str] = STANDARD_DOMAINS) -> Graph:
    """The exported graph of a prepared model: plain inputs, short names, standard ops
    (checked whole once written when its tensors stay out of the message)."""
    defaults = _plain_inputs(portable.model_proto)
    model = _standard(short_names(portable.model_proto), what, check=not portable.large_initializers,
                      allowed=allowed)
    return Graph(model, defaults, dict(portable.with_proto(model).large_initializers))


def step_graph(model: onnx.ModelProto, state_protos: Mapping[str, onnx.TensorProto],
               meta: TrainingMetadata, flat: bool = False,
               arrays: Mapping[str, np.ndarray] | None = None) -> Graph:
    """The training step: data, learning rates and state in; returned values and new state out.
    ``flat``: each optimizer node over its tensors laid end to end (for a GPU, :func:`~onnx_training_ops.prepare`).
    ``arrays``: the values of ``model``'s detached tensors (they stay detached)."""
    combined = combined_graph(model, 0, state_protos, meta)
    combined.graph.name = "training_step"
    return _graph(_prepared(combined, flat, arrays), "step model", domains(model))


def eval_graph(model: onnx.ModelProto, state_protos: Mapping[str, onnx.TensorProto],
               meta: TrainingMetadata, outputs: Sequence[str],
               arrays: Mapping[str, np.ndarray] | None = None) -> Graph:
    """The loss (eval mode: dropout off, BatchNorm running statistics) and ``outputs``, with
    the state it reads as inputs; the loss output keeps the training loss's name.
    ``arrays``: as :func:`step_graph`'s."""
    loss = ",".join(meta.loss)
    eval_loss = meta.eval_loss or loss
    if not eval_loss:
        raise TrainingOpError("export: the model names no loss (metadata 'loss'): the eval model "
                              "needs one; build it with build_training_model")
    derived = evaluation_model(model, eval_loss, [o for o in outputs if o != loss])
    combined = combined_graph(derived, 0, state_protos, meta, prune_inputs=True)
    combined.graph.name = "evaluate"
    if eval_loss != loss:  # the eval-mode loss, under the loss's name (what evaluate() returns)
        for out in combined.graph.output:
            if out.name == eval_loss:
                out.name = loss
        combined.graph.node.append(helper.make_node("Identity", [eval_loss], [loss], name="eval_loss"))
    return _graph(_prepared(combined, arrays=arrays), "eval model", domains(model))


def inference_graph(model: onnx.ModelProto, state_protos: Mapping[str, onnx.TensorProto],
                    state_file: str, offsets: Mapping[str, tuple[int, int]],
                    arrays: Mapping[str, np.ndarray] | None = None) -> Graph:
    """The main graph, its state initializers read from ``state_file`` (the exported
    safetensors) by ``offsets`` as ONNX external data: the weights are stored once.
    ``arrays``: as :func:`step_graph`'s (the other detached tensors stay detached)."""
    opened = inference_model(LargeModel(model, arrays, large=bool(arrays)), {}, with_state_values=False)
    exported = opened.model_proto
    exported.graph.name = exported.graph.name or "inference"
    for tensor in exported.graph.initializer:
        if tensor.name not in state_protos:
            continue
        offset, length = offsets[tensor.name]
        tensor.ClearField("raw_data")
        for values in ("float_data", "double_data", "int32_data", "int64_data", "uint64_data"):
            tensor.ClearField(values)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", state_file), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
    exported = _standard(short_names(exported), "inference model", check=False, allowed=domains(model))
    return Graph(exported, {}, dict(opened.with_proto(exported).large_initializers))


def check_file(path: str, what: str) -> None:
    """The full checker on a written model (its external data resolved beside it)."""
    try:
        onnx.checker.check_model(path, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise TrainingOpError(f"{what} ({path}): fails onnx.checker: {str(error).splitlines()[0]}") from error


def operators(model: onnx.ModelProto) -> list[str]:
    """The ops a model uses, ``domain:op`` sorted (``ai.onnx`` for the default domain)."""
    return sorted({f"{node.domain or 'ai.onnx'}:{node.op_type}" for g in all_graphs(model.graph) for node in g.node})
