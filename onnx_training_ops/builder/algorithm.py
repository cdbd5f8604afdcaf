"""The algorithm graph as the builder's steps write it, and the TrainingInfoProto it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

from ..passes._graph import unique_name


def value_info_from(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    return out


def tensor_vi(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, list(shape) if shape is not None else None)


@dataclass
class Algorithm:
    """The algorithm graph as the steps build it, and its update binding."""

    taken: set[str]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    value_info: list[onnx.ValueInfoProto] = field(default_factory=list)
    binding: list[tuple[str, str]] = field(default_factory=list)

    def name(self, base: str) -> str:
        return unique_name(self.taken, base)

    def bind(self, state: str, new: str, elem_type: int, shape) -> None:
        """``new`` is an output; the next step reads it as ``state``."""
        self.outputs.append(tensor_vi(new, elem_type, shape))
        self.binding.append((state, new))


def training_info(algo: Algorithm, initialization: onnx.GraphProto,
                   init_binding) -> onnx.TrainingInfoProto:
    info = onnx.TrainingInfoProto()
    info.initialization.CopyFrom(initialization)
    info.algorithm.CopyFrom(helper.make_graph(algo.nodes, "algorithm", algo.inputs, algo.outputs,
                                              initializer=algo.inits, value_info=algo.value_info))
    for key, value in init_binding:
        info.initialization_binding.add(key=key, value=value)
    for key, value in algo.binding:
        info.update_binding.add(key=key, value=value)
    return info
