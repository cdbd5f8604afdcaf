"""Train and eval modes, like torch's ``model.train()`` / ``model.eval()``.

``build_training_model(..., mode="train")`` keeps the main graph as the eval-mode inference
graph (:func:`to_inference`) and gives the algorithm graph a *training-mode* copy of the
forward pass (:func:`training_forward`): every value renamed under ``train/``, parameters and
graph inputs shared. In that copy:

* **BatchNormalization** normalizes with the batch statistics (biased variance) and updates
  the running statistics as torch does: ``running = (1 - m) running + m batch`` with torch's
  momentum ``m = 1 - momentum(ONNX)`` and the *unbiased* batch variance. The new running
  statistics are algorithm outputs bound to the main graph's running-statistic initializers
  (state, never trained).
* **Dropout** (a model exported with ``training=torch.onnx.TrainingMode.TRAINING`` keeps its
  Dropout nodes) multiplies by a fresh mask each step, scaled by ``1 / (1 - ratio)``. The mask
  is a counter-based hash of (seed, node, step T, element): the same seed gives the same
  masks, a resumed checkpoint the same masks as an uninterrupted run, with no RNG state.

Both are written in standard ops that have derivative rules, so the Gradient expansion
differentiates the training-mode forward pass like any other graph.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import TrainingOpError

PREFIX = "train/"
MASK_BITS = 2 ** 32
# odd multipliers below 2**31 keep every product inside int64
MIX_ROUNDS = ((0x2C1B3C6D, 15), (0x297A2D39, 13), (0x3C6EF373, 16), (0x1B873593, 15),
              (0x5BD1E995, 13))
STEP_MULTIPLIER = 0x3504F333
INDEX_MULTIPLIER = 0x1E3779B1


class _Emit:
    def __init__(self, unique: Callable[[str], str], opset: int):
        self.unique, self.opset, self.nodes = unique, opset, []

    def op(self, op_type: str, inputs, hint: str, **attrs) -> str:
        out = self.unique(f"{PREFIX}{hint}/{op_type}")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value, hint: str) -> str:
        out = self.unique(f"{PREFIX}{hint}/const")
        self.nodes.append(helper.make_node("Constant", [], [out], name=out,
                                           value=numpy_helper.from_array(np.asarray(value))))
        return out

    def reduce_mean(self, x: str, axes: list[int], hint: str) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const(np.array(axes, np.int64), hint)], hint,
                           keepdims=1)
        return self.op("ReduceMean", [x], hint, axes=axes, keepdims=1)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _batch_norm(em: _Emit, node: onnx.NodeProto, x: str, y: str, rank: int, inits: set[str]):
    """Batch-statistics BN; returns [(running stat initializer, its new value)]."""
    hint = node.name or node.output[0]
    _, scale, bias, mean, var = node.input[:5]
    axes = [0] + list(range(2, rank))
    per_channel = [1, -1] + [1] * (rank - 2)
    shape = em.const(np.array(per_channel, np.int64), hint)
    batch_mean = em.reduce_mean(x, axes, hint)
    centered = em.op("Sub", [x, batch_mean], hint)
    batch_var = em.reduce_mean(em.op("Mul", [centered, centered], hint), axes, hint)
    eps = em.op("CastLike", [em.const(np.float32(_attr(node, "epsilon", 1e-5)), hint), x], hint)
    inv = em.op("Reciprocal", [em.op("Sqrt", [em.op("Add", [batch_var, eps], hint)], hint)], hint)
    normalized = em.op("Mul", [centered, inv], hint)
    scaled = em.op("Mul", [normalized, em.op("Reshape", [scale, shape], hint)], hint)
    em.nodes.append(helper.make_node("Add", [scaled, em.op("Reshape", [bias, shape], hint)], [y],
                                     name=f"{PREFIX}{hint}/output"))
    if mean not in inits or var not in inits:
        return []
    # torch: running = (1 - m) running + m batch, m = 1 - ONNX momentum; unbiased variance
    m = 1.0 - float(_attr(node, "momentum", 0.9))
    size = em.op("Size", [x], hint)
    channels = em.op("Gather", [em.op("Shape", [x], hint), em.const(np.int64(1), hint)], hint,
                     axis=0)
    n = em.op("CastLike", [em.op("Div", [size, channels], hint), x], hint)
    one = em.op("CastLike", [em.const(np.float32(1.0), hint), x], hint)
    bessel = em.op("Div", [n, em.op("Sub", [n, one], hint)], hint)
    flat = em.const(np.array([-1], np.int64), hint)
    new_stats = []
    for stat, batch in ((mean, batch_mean), (var, em.op("Mul", [batch_var, bessel], hint))):
        keep = em.op("CastLike", [em.const(np.float32(1.0 - m), hint), x], hint)
        take = em.op("CastLike", [em.const(np.float32(m), hint), x], hint)
        new = em.op("Add", [em.op("Mul", [stat, keep], hint),
                            em.op("Mul", [em.op("Reshape", [batch, flat], hint), take], hint)],
                    hint)
        new_stats.append((stat, new))
    return new_stats


def _mix(em: _Emit, h: str, hint: str) -> str:
    """Rounds of h += (h >> s)^2; h *= m (mod 2**32): an xorshift-multiply hash written with
    int64 Div/Mul/Add/Mod only (no bitwise ops before opset 18). Every product stays below
    2**63."""
    modulus = em.const(np.int64(MASK_BITS), hint)
    for multiplier, shift in MIX_ROUNDS:
        high = em.op("Div", [h, em.const(np.int64(2 ** shift), hint)], hint)
        square = em.op("Mod", [em.op("Mul", [high, high], hint), modulus], hint)
        h = em.op("Mod", [em.op("Add", [h, square], hint), modulus], hint)
        h = em.op("Mod", [em.op("Mul", [h, em.const(np.int64(multiplier), hint)], hint),
                          modulus], hint)
    return h


def _uniform(em: _Emit, x: str, step: str, stream: int, hint: str) -> str:
    """A float in [0, 1) per element of ``x``: hash(element index + hash(step, stream)).
    Consecutive steps, streams (seed, node) and neighbouring elements are uncorrelated within
    sampling error (tests/test_train_mode.py)."""
    modulus = em.const(np.int64(MASK_BITS), hint)
    salt = em.op("Add", [em.op("Mul", [em.op("Cast", [step], hint, to=TensorProto.INT64),
                                       em.const(np.int64(STEP_MULTIPLIER), hint)], hint),
                         em.const(np.int64((stream * 0x1B873593 + 0x6A09E667) % MASK_BITS),
                                  hint)], hint)
    salt = _mix(em, em.op("Mod", [salt, modulus], hint), hint)
    size = em.op("Size", [x], hint)
    index = em.op("Range", [em.const(np.int64(0), hint), size, em.const(np.int64(1), hint)],
                  hint)
    index = em.op("Reshape", [index, em.op("Shape", [x], hint)], hint)
    spread = em.op("Mod", [em.op("Mul", [index, em.const(np.int64(INDEX_MULTIPLIER), hint)],
                                 hint), modulus], hint)
    h = _mix(em, em.op("Mod", [em.op("Add", [spread, salt], hint), modulus], hint), hint)
    return em.op("Div", [em.op("Cast", [h], hint, to=TensorProto.DOUBLE),
                         em.const(np.float64(MASK_BITS), hint)], hint)


def _dropout(em: _Emit, node: onnx.NodeProto, x: str, outputs: list[str], step: str,
             stream: int, constants: dict) -> None:
    hint = node.name or node.output[0]
    ratio_name = node.input[1] if len(node.input) > 1 and node.input[1] else None
    ratio = float(np.asarray(constants[ratio_name])) if ratio_name in constants else \
        float(_attr(node, "ratio", 0.5))
    if ratio_name and ratio_name not in constants:
        raise TrainingOpError(f"Dropout node {hint!r}: ratio {ratio_name!r} must be a constant")
    if not 0.0 <= ratio < 1.0:
        raise TrainingOpError(f"Dropout node {hint!r}: ratio must be in [0, 1), found {ratio}")
    keep = em.op("GreaterOrEqual", [_uniform(em, x, step, stream, hint),
                                    em.const(np.float64(ratio), hint)], hint)
    scale = em.op("CastLike", [em.const(np.float32(1.0 / (1.0 - ratio)), hint), x], hint)
    zero = em.op("CastLike", [em.const(np.float32(0.0), hint), x], hint)
    kept = em.op("Where", [keep, x, zero], hint)
    em.nodes.append(helper.make_node("Mul", [kept, scale], [outputs[0]],
                                     name=f"{PREFIX}{hint}/output"))
    if len(outputs) > 1 and outputs[1]:
        em.nodes.append(helper.make_node("Identity", [keep], [outputs[1]],
                                         name=f"{PREFIX}{hint}/mask"))


def _constants(graph: onnx.GraphProto) -> dict:
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute:
            v = helper.get_attribute_value(n.attribute[0])
            values[n.output[0]] = numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) \
                else np.asarray(v)
    return values


def training_forward(graph: onnx.GraphProto, ranks: dict[str, int], opset: int, step: str,
                     seed: int, unique: Callable[[str], str]):
    """The training-mode copy of ``graph``'s nodes.

    Returns (nodes, {eval value name: train value name}, [(running stat, new value)]).
    ``step`` names the int64 update count (a fresh dropout mask each step), ``ranks`` the
    known ranks of BatchNormalization inputs.
    """
    inits = {t.name for t in graph.initializer}
    constants = _constants(graph)
    renamed: dict[str, str] = {}
    em = _Emit(unique, opset)
    updates = []
    for index, node in enumerate(graph.node):
        inputs = [renamed.get(i, i) for i in node.input]
        outputs = []
        for o in node.output:
            if o:
                renamed[o] = unique(PREFIX + o)
            outputs.append(renamed.get(o, ""))
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            rank = ranks.get(node.input[0])
            if rank is None:
                raise TrainingOpError(f"BatchNormalization node {node.name or node.output[0]!r}: "
                                      "the rank of its input is unknown; mode='train' needs it")
            updates += _batch_norm(em, node, inputs[0], outputs[0], rank, inits)
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            _dropout(em, node, inputs[0], outputs, step, seed * 1000003 + index, constants)
        else:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = unique(PREFIX + (node.name or node.output[0]))
            del copy.input[:]
            copy.input.extend(inputs)
            del copy.output[:]
            copy.output.extend(outputs)
            em.nodes.append(copy)
    return em.nodes, renamed, updates


def to_inference(graph: onnx.GraphProto) -> None:
    """Eval mode in place: Dropout without training_mode, BatchNormalization with
    training_mode=0 and its single output (a model exported in training mode)."""
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Dropout" and len(node.input) > 2:
            del node.input[2:]
        if node.op_type == "BatchNormalization" and _attr(node, "training_mode", 0):
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(kept)
            del node.output[1:]
