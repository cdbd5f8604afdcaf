"""The initialization graph: optimizer state at its initial value, T = 0, and its binding."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..passes._graph import unique_name
from ..storage.tensors import constant_array, set_location
from .algorithm import tensor_vi
from .param_groups import Group


def initialization_graph(params, groups: list[Group], state_names: dict[str, dict[str, str]], t_name: str,
                         taken: set[str], algo_inits: list, arrays: dict | None = None,
                         ) -> tuple[onnx.GraphProto, list[tuple[str, str]]]:
    """The initialization graph (V/H at their group's initial value, T = 0) and its binding;
    the state initializers (same values) are appended to ``algo_inits``. With ``arrays``
    (a large model) their values stay out of the message: read-only constant arrays that
    take no memory, under ``#<name>`` keys added to ``arrays``."""
    init_nodes, init_outputs, init_binding = [], [], []
    init_t = unique_name(taken, "optimizer.T.init")
    init_nodes.append(
        helper.make_node("Constant", [], [init_t], value=numpy_helper.from_array(np.array(0, np.int64)),
                         name=unique_name(taken, "init/T"))
    )
    init_outputs.append(tensor_vi(init_t, TensorProto.INT64, []))
    init_binding.append((t_name, init_t))
    optimizer_of = {p: g.optimizer for g in groups for p in g.params}
    for p in params:
        optimizer = optimizer_of[p.name]
        dtype = helper.tensor_dtype_to_np_dtype(p.data_type)
        shape_name = unique_name(taken, f"{p.name}.shape")
        init_nodes.append(
            helper.make_node("Constant", [], [shape_name], value=numpy_helper.from_array(np.array(p.dims, np.int64)),
                             name=unique_name(taken, f"init/{p.name}.shape"))
        )
        for s in optimizer.states:
            state = state_names[p.name][s]
            value = optimizer.initial_value(s)
            algo_inits.append(_filled(state, p.data_type, p.dims, value, arrays))
            out = unique_name(taken, f"{state}.init")
            init_nodes.append(
                helper.make_node(
                    "ConstantOfShape", [shape_name], [out], name=unique_name(taken, f"init/{state}"),
                    value=numpy_helper.from_array(np.array([value], dtype)),
                )
            )
            init_outputs.append(tensor_vi(out, p.data_type, p.dims))
            init_binding.append((state, out))
    return helper.make_graph(init_nodes, "initialization", [], init_outputs), init_binding


def _filled(name: str, elem_type: int, dims, value, arrays: dict | None) -> onnx.TensorProto:
    """An initializer of ``dims`` filled with ``value``: in the message, or (``arrays``)
    detached as a constant array."""
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    if arrays is None:
        return numpy_helper.from_array(np.full(tuple(dims), value, dtype), name)
    tensor = onnx.TensorProto(name=name, data_type=elem_type)
    tensor.dims.extend(dims)
    set_location(tensor, f"#{name}")
    arrays[f"#{name}"] = constant_array(value, dtype, dims)
    return tensor
