"""Appending ONNX nodes with fresh names: the builder's, the optimizer emitters' and the stages' tool."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper


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
