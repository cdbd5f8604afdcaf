"""Pass: unroll LSTM, GRU and RNN nodes of graphs that take a Gradient into standard ops.

The unrolled cell (MatMul, Add, Sigmoid/Tanh/Relu, Mul, Where...) has derivative rules, so
the Gradient expansion differentiates it like any other subgraph. Only graphs holding a
``Gradient`` node are rewritten (inference graphs keep the fused op), and the rewrite is
exact: the same formulas as the ONNX spec, in its gate order (LSTM ``iofc``, GRU ``zrh``).

Covered: forward, reverse and bidirectional; ``initial_h``/``initial_c``; ``sequence_lens``
(steps past a sequence's length keep its state and output zeros, as the spec says); both
layouts; GRU ``linear_before_reset``; activations Sigmoid/Tanh/Relu (torch's RNN
``nonlinearity``). Not covered (clear error): peepholes, ``clip``, ``input_forget``, other
activations, and a sequence length that is not static (the unrolled graph has one copy of
the cell per time step: 13-20 nodes per step and direction).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, helper, numpy_helper

from ..errors import TrainingOpError
from ..schema import DOMAIN
from ..walk import all_graphs
from ._graph import value_types

RECURRENT = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"],
                       "RNN": ["Tanh"]}
SUPPORTED_ACTIVATIONS = {"Sigmoid", "Tanh", "Relu"}


class _Builder:
    """Emits nodes with names under one prefix."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self.count = prefix, [], 0

    def op(self, op_type: str, inputs, n_out: int = 1, **attrs):
        self.count += 1
        outs = [f"{self.prefix}/{op_type}_{self.count}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=outs[0], **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: np.ndarray) -> str:
        self.count += 1
        name = f"{self.prefix}/const_{self.count}"
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(np.asarray(value))))
        return name


def _fail(node: onnx.NodeProto, what: str) -> TrainingOpError:
    return TrainingOpError(f"{node.op_type} node {node.name or node.output[0]!r}: {what} "
                           "cannot be differentiated (the unrolled form does not cover it)")


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _checked_attributes(node: onnx.NodeProto, a: dict) -> tuple[str, list[str]]:
    """The node's direction and activations; a clear error for what the unrolling does not cover."""
    for unsupported in ("clip", "input_forget"):
        if a.get(unsupported):
            raise _fail(node, f"attribute {unsupported}")
    direction = a.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    acts = [x.decode() if isinstance(x, bytes) else x for x in a.get("activations", [])]
    acts = acts[:len(DEFAULT_ACTIVATIONS[node.op_type])] or DEFAULT_ACTIVATIONS[node.op_type]
    if set(acts) - SUPPORTED_ACTIVATIONS or a.get("activation_alpha") or a.get("activation_beta"):
        raise _fail(node, f"activations {acts}")
    return direction, acts


def _input_projection(b: _Builder, node: onnx.NodeProto, a: dict, x: str, w: str, bias: str, at: str,
                      width: int) -> tuple[str, str | None]:
    """One direction's ``X W^T`` (+ the biases) for every step, [seq, batch, gates*H], and the
    recurrence bias left for the cell (GRU with linear_before_reset: Rbh stays inside the reset
    product), else None."""
    w_t = b.op("Transpose", [b.op("Gather", [w, at], axis=0)])  # [I, gates*H]
    xw = b.op("MatMul", [x, w_t])  # [seq, batch, gates*H]
    if not bias:
        return xw, None
    wb, rb = b.op("Split", [b.op("Gather", [bias, at], axis=0), b.const(np.array([width] * 2))], 2, axis=0)
    if node.op_type != "GRU" or not a.get("linear_before_reset", 0):
        return b.op("Add", [xw, b.op("Add", [wb, rb])]), None
    return b.op("Add", [xw, wb]), rb


def _unroll(node: onnx.NodeProto, types: dict) -> list[onnx.NodeProto]:
    op, gates = node.op_type, RECURRENT[node.op_type]
    a = _attrs(node)
    direction, acts = _checked_attributes(node, a)
    dirs = 2 if direction == "bidirectional" else 1
    layout = int(a.get("layout", 0))
    hidden = int(a["hidden_size"])
    ins = list(node.input) + [""] * (8 - len(node.input))
    x, w, r, bias, seq_lens, init_h = ins[:6]
    init_c = ins[6] if op == "LSTM" else ""
    if op == "LSTM" and ins[7]:
        raise _fail(node, "peephole input P")
    xt = types.get(x)
    steps = None if xt is None or xt.shape is None else xt.shape[1 if layout else 0]
    if not isinstance(steps, int):
        raise _fail(node, f"a sequence length that is not static (input {x!r})")
    b = _Builder(node.name or node.output[0])
    if layout:  # work in layout 0: [seq, batch, ...]
        x = b.op("Transpose", [x], perm=[1, 0, 2])
        init_h = b.op("Transpose", [init_h], perm=[1, 0, 2]) if init_h else ""
        init_c = b.op("Transpose", [init_c], perm=[1, 0, 2]) if init_c else ""
    zeros_h = None
    if not init_h or (op == "LSTM" and not init_c):
        batch = b.op("Slice", [b.op("Shape", [x]), b.const(np.array([1])), b.const(np.array([2]))])
        shape = b.op("Concat", [batch, b.const(np.array([hidden]))], axis=0)
        zeros_h = b.op("CastLike", [b.op("ConstantOfShape", [shape]), w])
    mask = None
    if seq_lens:
        lens = b.op("Unsqueeze", [b.op("Cast", [seq_lens], to=onnx.TensorProto.INT64),
                                  b.const(np.array([1]))])  # [batch, 1]
    ys, last_h, last_c = [], [], []
    for d in range(dirs):
        at = b.const(np.array(d))
        r_t = b.op("Transpose", [b.op("Gather", [r, at], axis=0)])  # [H, gates*H]
        xw, rb = _input_projection(b, node, a, x, w, bias, at, gates * hidden)
        h = b.op("Gather", [init_h, at], axis=0) if init_h else zeros_h
        c = (b.op("Gather", [init_c, at], axis=0) if init_c else zeros_h) if op == "LSTM" else None
        reverse = direction == "reverse" or d == 1
        outs: list = [None] * steps
        for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
            xt_ = b.op("Gather", [xw, b.const(np.array(t))], axis=0)  # [batch, gates*H]
            h_new, c_new = _cell(b, op, xt_, h, c, r_t, rb, hidden, acts,
                                 int(a.get("linear_before_reset", 0)))
            if seq_lens:
                mask = b.op("Less", [b.const(np.array(t)), lens])  # [batch, 1]
                outs[t] = b.op("Where", [mask, h_new, b.op("Sub", [h_new, h_new])])
                h = b.op("Where", [mask, h_new, h])
                c = b.op("Where", [mask, c_new, c]) if c_new else None
            else:
                outs[t], h, c = h_new, h_new, c_new
        ys.append(b.op("Concat", [b.op("Unsqueeze", [o, b.const(np.array([0, 1]))])
                                  for o in outs], axis=0))  # [seq, 1, batch, H]
        last_h.append(b.op("Unsqueeze", [h, b.const(np.array([0]))]))
        if c is not None:
            last_c.append(b.op("Unsqueeze", [c, b.const(np.array([0]))]))
    results = [b.op("Concat", ys, axis=1), b.op("Concat", last_h, axis=0)]
    if op == "LSTM":
        results.append(b.op("Concat", last_c, axis=0))
    if layout:
        results = [b.op("Transpose", [results[0]], perm=[2, 0, 1, 3])] + \
                  [b.op("Transpose", [v], perm=[1, 0, 2]) for v in results[1:]]
    for value, out in zip(results, node.output):
        if out:
            b.nodes.append(helper.make_node("Identity", [value], [out], name=f"{b.prefix}/{out}"))
    return b.nodes


def _activate(b: _Builder, name: str, v: str) -> str:
    return b.op(name, [v])


def _cell(b: _Builder, op: str, xw: str, h: str, c, r_t: str, rb, hidden: int, acts: list,
          linear_before_reset: int):
    """One time step: (new h, new c or None)."""
    hr = b.op("MatMul", [h, r_t])
    if op == "RNN":
        return _activate(b, acts[0], b.op("Add", [xw, hr])), None
    if op == "LSTM":
        i, o, f, g = b.op("Split", [b.op("Add", [xw, hr]), b.const(np.array([hidden] * 4))], 4,
                          axis=-1)
        f_act, g_act, h_act = acts
        c_new = b.op("Add", [b.op("Mul", [_activate(b, f_act, f), c]),
                             b.op("Mul", [_activate(b, f_act, i), _activate(b, g_act, g)])])
        h_new = b.op("Mul", [_activate(b, f_act, o), _activate(b, h_act, c_new)])
        return h_new, c_new
    f_act, g_act = acts
    sizes = b.const(np.array([hidden] * 3))
    xz, xr, xh = b.op("Split", [xw, sizes], 3, axis=-1)
    if rb is not None:
        hr = b.op("Add", [hr, rb])
    hz, hrr, hh = b.op("Split", [hr, sizes], 3, axis=-1)
    z = _activate(b, f_act, b.op("Add", [xz, hz]))
    reset = _activate(b, f_act, b.op("Add", [xr, hrr]))
    if linear_before_reset:
        cand = b.op("Add", [xh, b.op("Mul", [reset, hh])])
    else:  # (r * h) R_h^T: recompute with the reset state (R_h's rows of r_t)
        r_h = b.op("Slice", [r_t, b.const(np.array([2 * hidden])), b.const(np.array([3 * hidden])),
                             b.const(np.array([1]))])
        cand = b.op("Add", [xh, b.op("MatMul", [b.op("Mul", [reset, h]), r_h])])
    h_tilde = _activate(b, g_act, cand)
    one_minus_z = b.op("Sub", [b.op("CastLike", [b.const(np.array(1.0, np.float32)), z]), z])
    return b.op("Add", [b.op("Mul", [one_minus_z, h_tilde]), b.op("Mul", [z, h])]), None


def _has_gradient(graph: GraphProto) -> bool:
    return any(n.op_type == "Gradient" and n.domain == DOMAIN for n in graph.node)


def lower_recurrent(model: ModelProto) -> ModelProto:
    """Unroll the recurrent nodes of every graph holding a Gradient node (in place)."""
    graphs = [g for g in all_graphs(model.graph) if _has_gradient(g)]
    if not any(n.op_type in RECURRENT and n.domain in ("", "ai.onnx")
               for g in graphs for n in g.node):
        return model
    types = value_types(model)
    for graph in graphs:
        nodes = []
        for node in graph.node:
            if node.op_type in RECURRENT and node.domain in ("", "ai.onnx"):
                nodes.extend(_unroll(node, types))
            else:
                nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    return model
