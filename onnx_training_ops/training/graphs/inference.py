"""The main (inference) graph of a training model: for ``run`` and ``export_inference_model``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ...builder.model_metadata import META_PREFIX
from ...errors import TrainingOpError
from ...passes.fit_runtime import fit_runtime
from ...runtime.session import InferenceSession
from ...schema import DOMAIN
from ...storage.large_model import LargeModel
from ...walk import all_graphs
from .pruning import prune_dead_nodes, prune_unused_inputs, used_names
from .stages import typed_values


def inference_model(
    model: LargeModel, state: Mapping[str, np.ndarray], with_state_values: bool = True,
    copy: bool = True,
) -> LargeModel:
    """The main graph without training_info and the builder's metadata (with the current
    state if asked): a LargeModel over ``model``'s arrays, the state's big arrays copies, or
    with ``copy=False`` the live arrays (for a writer that holds them still)."""
    out = model.copy()
    exported = out.model_proto
    del exported.training_info[:]
    kept = [m for m in exported.metadata_props if not m.key.startswith(META_PREFIX)]
    del exported.metadata_props[:]
    exported.metadata_props.extend(kept)
    if with_state_values:
        for tensor in exported.graph.initializer:
            if tensor.name in state:
                out.set_value(tensor, state[tensor.name], copy=copy)
    uses_domain = any(n.domain == DOMAIN for g in all_graphs(exported.graph) for n in g.node)
    if not uses_domain:
        kept_ops = [o for o in exported.opset_import if o.domain != DOMAIN]
        del exported.opset_import[:]
        exported.opset_import.extend(kept_ops)
    return out.with_proto(fit_runtime(exported))


def with_outputs(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """``model`` (an inference model) computing only ``outputs`` (any values of its graph),
    without the nodes, inputs and initializers they do not need: onnxruntime-training's
    ``export_model_for_inferencing(path, graph_output_names)``."""
    if isinstance(outputs, str) or not outputs:
        raise TrainingOpError(f"export_inference_model: outputs must be a non-empty list of value names, "
                              f"found {outputs!r}")
    values = typed_values(model, list(outputs), "export_inference_model")
    graph = model.graph
    del graph.output[:]
    graph.output.extend(values)
    prune_dead_nodes(graph)
    prune_unused_inputs(graph)
    used = used_names(graph)
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return model


def inference_session(
    model: LargeModel,
    state: Mapping[str, np.ndarray],
    sess_options: ort.SessionOptions | None,
    providers: Sequence[str | tuple[str, dict]],
) -> tuple[InferenceSession, list[str]]:
    """A session of the main graph taking the state as inputs; returns it and the names of those inputs."""
    model = inference_model(model, state, with_state_values=False)
    graph = model.model_proto.graph
    if not graph.output:
        raise TrainingOpError("run: the main graph has no outputs (a from_graph session has no inference graph)")
    state_inputs = []
    kept = []
    declared = {vi.name for vi in graph.input}
    for tensor in graph.initializer:
        if tensor.name in state:
            state_inputs.append(tensor.name)
            if tensor.name not in declared:
                graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            kept.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    model = model.with_proto(model.model_proto)  # the state's initial values are inputs now
    session = InferenceSession(model, sess_options=sess_options, providers=providers)
    return session, state_inputs
