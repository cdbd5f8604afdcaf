"""A training model for a plain graph that holds the optimizer itself (``TrainingSession.from_graph``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import TrainingOpError
from ...storage.model_files import ModelLike, load_model
from ...storage.tensors import proto_of
from ...walk import drop_named
from ..arrays import dtype_name, np_dtype


def graph_to_training_model(
    model: ModelLike, feedback: Mapping[str, str], initial_state: Mapping[str, np.ndarray] | None = None
) -> onnx.ModelProto:
    """A training model for a plain graph with explicit state (see :meth:`TrainingSession.from_graph`)."""
    proto = proto_of(load_model(model))  # large=False: every tensor in the message
    graph = proto.graph
    initial_state = dict(initial_state or {})
    inputs = {vi.name: vi for vi in graph.input}
    outputs = {vo.name for vo in graph.output}
    inits = {t.name: t for t in graph.initializer}
    if not feedback:
        raise TrainingOpError("from_graph: feedback is empty; map each new-state output to its state input")
    targets: dict[str, str] = {}  # state input -> the output fed back into it
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
                if tt.elem_type and np_dtype(tt.elem_type) != value.dtype:
                    raise TrainingOpError(
                        f"from_graph: initial_state[{name!r}] is {dtype_name(value.dtype)}, the input is "
                        f"{dtype_name(np_dtype(tt.elem_type))}"
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
    drop_named(algo.input, targets)
    drop_named(algo.initializer, targets)
    main = helper.make_graph([], "state", [], [], initializer=state_tensors)
    out = helper.make_model(main, opset_imports=list(proto.opset_import))
    out.ir_version = max(proto.ir_version, 7)
    out.functions.extend(proto.functions)
    info = out.training_info.add()
    info.algorithm.CopyFrom(algo)
    for name, fed_back in targets.items():
        info.update_binding.add(key=name, value=fed_back)
    return out
