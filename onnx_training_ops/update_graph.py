"""Emitting optimizer updates into the algorithm graph.

:class:`Ops` appends nodes with fresh names; :func:`emit_update` writes one optimizer step
for a group of tensors: one multi-tensor node of the training domain (Adam, Momentum,
Adagrad), or standard ops per tensor for optimizers the domain lacks (RMSProp). The
builder's dense update and the row updates of :mod:`.sparse_updates` both go through it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .rmsprop import RMSProp, emit_rmsprop
from .schema import DOMAIN


class Ops:
    """Nodes appended to ``nodes`` with names from ``unique`` (the builder's name table)."""

    def __init__(self, unique: Callable[[str], str], nodes: list[onnx.NodeProto], prefix: str):
        self.unique, self.nodes, self.prefix = unique, nodes, prefix

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None,
           n_out: int = 1, domain: str = "", **attrs):
        """Append one node; returns its output name (its output names when ``n_out > 1``)."""
        outs = [out] if out is not None else [self.unique(f"{self.prefix}/{op_type}")
                                              for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None,
                                           name=self.unique(f"{self.prefix}/{op_type}"), **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: np.ndarray) -> str:
        name = self.unique(f"{self.prefix}/const")
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(np.asarray(value))))
        return name


def emit_update(ops: Ops, optimizer, r: str, t: str, xs: Sequence[str], gs: Sequence[str],
                states: dict[str, list[str]], new_xs: Sequence[str],
                new_states: dict[str, list[str]], dtypes: Sequence[np.dtype],
                attributes: dict | None = None, label: str = "") -> None:
    """One optimizer step of tensors ``xs`` (gradients ``gs``, state values ``states[s][i]``)
    writing ``new_xs`` and ``new_states``. ``r``: the learning rate (float, or double when
    every tensor is double); ``attributes`` override the domain op's attributes; ``label``
    ends the node's name (a parameter group's)."""
    if isinstance(optimizer, RMSProp):
        casts: dict[np.dtype, str] = {}
        for i, (x, g, dtype) in enumerate(zip(xs, gs, dtypes)):
            if dtype not in casts:  # R in each tensor's dtype
                casts[dtype] = ops.op("Cast", [r], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
            emit_rmsprop(ops, optimizer, casts[dtype], x, g, {s: v[i] for s, v in states.items()},
                         new_xs[i], {s: v[i] for s, v in new_states.items()}, np.dtype(dtype))
        return
    inputs, outputs = [r, t, *xs, *gs], list(new_xs)
    for s in optimizer.states:
        inputs += states[s]
        outputs += new_states[s]
    ops.nodes.append(helper.make_node(
        optimizer.op_type, inputs, outputs, domain=DOMAIN,
        name=ops.unique(f"optimizer/{optimizer.op_type}{label}"),
        **{**optimizer.attributes(), **(attributes or {})}))
