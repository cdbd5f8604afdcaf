"""Emitting optimizer updates into the algorithm graph.

:func:`emit_update` writes one optimizer step for a group of tensors: one multi-tensor node
of the training domain (Adam, Momentum, Adagrad), or standard ops for optimizers the domain
lacks (RMSProp, onnxruntime-training's AdamW: listed in
:data:`onnx_training_ops.optim.registry.STANDARD_OP_UPDATES`). The builder's dense update and
the row updates of :mod:`.sparse_updates` both go through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import helper

from ..optim.registry import STANDARD_OP_UPDATES
from ..schema import DOMAIN
from .ops import Ops


def emit_update(ops: Ops, optimizer, r: str, t: str, xs: Sequence[str], gs: Sequence[str],
                states: dict[str, list[str]], new_xs: Sequence[str],
                new_states: dict[str, list[str]], dtypes: Sequence[np.dtype],
                attributes: dict | None = None, label: str = "") -> None:
    """One optimizer step of tensors ``xs`` (gradients ``gs``, state values ``states[s][i]``)
    writing ``new_xs`` and ``new_states``. ``r``: the learning rate (float, or double when
    every tensor is double); ``attributes`` override the domain op's attributes; ``label``
    ends the node's name (a parameter group's)."""
    standard = STANDARD_OP_UPDATES.get(type(optimizer))
    if standard is not None:
        standard(ops, optimizer, r, t, xs, gs, states, new_xs, new_states, dtypes)
        return
    inputs, outputs = [r, t, *xs, *gs], list(new_xs)
    for s in optimizer.states:
        inputs += states[s]
        outputs += new_states[s]
    ops.nodes.append(helper.make_node(
        optimizer.op_type, inputs, outputs, domain=DOMAIN,
        name=ops.unique(f"optimizer/{optimizer.op_type}{label}"),
        **{**optimizer.attributes(), **(attributes or {})}))
