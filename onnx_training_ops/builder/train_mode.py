"""Train and eval modes, like torch's ``model.train()`` / ``model.eval()``.

``build_training_model(..., mode="train")`` keeps the main graph as the eval-mode inference
graph (:func:`.eval_mode.to_inference`) and gives the algorithm graph a *training-mode* copy of the
forward pass (:func:`training_forward`), built by three named passes:

* :func:`copy_forward` — every node copied, every value it computes renamed under ``train/``;
  initializers and graph inputs keep their names (the parameters are shared).
* :func:`lower_batch_norm` — BatchNormalization on the batch statistics (mean and biased
  variance over every axis but 1, given to the standard op, its derivative rule the closed
  form of ``autodiff.rules_norm``), plus torch's running-statistic
  update ``running = (1 - m) running + m batch`` with ``m = 1 - momentum(ONNX)`` and the
  *unbiased* batch variance for ``running_var``. The new running statistics are returned
  for the builder to bind to the main graph's initializers: state, never trained.
* :func:`lower_dropout` — Dropout as ``x * mask / (1 - ratio)`` with a fresh mask each step:
  the mask compares a counter-based hash of (seed, Dropout node, step T, element index) with
  the ratio (:func:`splitmix64`), so masks depend only on the seed and the state T — the
  same seed gives the same masks, a resumed checkpoint the masks of an uninterrupted run.

Everything is written in ops with derivative rules, so the Gradient expansion
differentiates the training-mode pass like any other graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..autodiff.rules_norm import BATCH_STATISTICS_DOC
from ..errors import TrainingOpError
from ..storage.tensors import constant_values
from ..walk import all_graphs
from ._nodes import PREFIX, STANDARD_DOMAINS
from ._nodes import is_standard as _is
from ._nodes import label as _label
from .eval_mode import eval_mode_nodes

# SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c): output n of the generator
# seeded with s is mix(s + (n + 1) * GAMMA); mix = xorshift-multiply, xorshift-multiply, xorshift
GAMMA = 0x9E3779B97F4A7C15
MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))
UINT64 = 2 ** 64
STEP_STRIDE = 2 ** 32  # counter = T * 2**32 + element index: distinct for < 2**32 elements
TRAIN_OPSET = 15  # CastLike
DROPOUT_OPSET = 18  # BitwiseXor


class _Emit:
    """Appends nodes named under ``train/<hint>/`` to ``nodes``."""

    def __init__(self, unique: Callable[[str], str], opset: int, hint: str):
        self.unique, self.opset, self.hint = unique, opset, hint
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, inputs, **attrs) -> str:
        out = self.unique(f"{PREFIX}{self.hint}/{op_type}")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value) -> str:
        out = self.unique(f"{PREFIX}{self.hint}/const")
        self.nodes.append(helper.make_node("Constant", [], [out], name=out,
                                           value=numpy_helper.from_array(np.asarray(value))))
        return out

    def like(self, value: float, x: str, dtype=None) -> str:
        """A constant of ``x``'s type: of ``dtype`` when known, else a float32 CastLike ``x``."""
        if dtype is not None:
            return self.const(np.asarray(value, dtype))
        return self.op("CastLike", [self.const(np.float32(value)), x])

    def output(self, op_type: str, inputs, out: str) -> None:
        """The node writing the lowered node's own output ``out``."""
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=self.unique(f"{PREFIX}{self.hint}/output")))

    def reduce_mean(self, x: str, axes: list[int]) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const(np.array(axes, np.int64))], keepdims=1)
        return self.op("ReduceMean", [x], axes=axes, keepdims=1)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ---------------------------------------------------------------- copy forward

def copy_forward(graph: onnx.GraphProto, unique: Callable[[str], str]
                 ) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """A copy of ``graph``'s nodes computing every value under a new name (``train/<name>``);
    initializers and graph inputs keep theirs. Subgraphs read the renamed outer values.
    Returns (nodes, {original value name: its name in the copy})."""
    renamed: dict[str, str] = {}
    nodes = []
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = unique(PREFIX + _label(node))
        _set(copy.input, [renamed.get(i, i) for i in node.input])
        for sub in (a.g for a in copy.attribute if a.HasField("g")):
            _rename_outer_reads(sub, renamed)
        for sub_list in (a.graphs for a in copy.attribute if len(a.graphs)):
            for sub in sub_list:
                _rename_outer_reads(sub, renamed)
        for i, o in enumerate(node.output):
            if o:
                renamed[o] = unique(PREFIX + o)
                copy.output[i] = renamed[o]
        nodes.append(copy)
    return nodes, renamed


def _rename_outer_reads(graph: onnx.GraphProto, renamed: Mapping[str, str]) -> None:
    for g in all_graphs(graph):
        for node in g.node:
            _set(node.input, [renamed.get(i, i) for i in node.input])


def _set(field, values) -> None:
    del field[:]
    field.extend(values)


def _replace(nodes: list[onnx.NodeProto], op_type: str, lower) -> list[onnx.NodeProto]:
    """``nodes`` with each standard ``op_type`` node replaced by ``lower(node, ordinal)``."""
    out, ordinal = [], 0
    for node in nodes:
        if _is(node, op_type):
            out += lower(node, ordinal)
            ordinal += 1
        else:
            out.append(node)
    return out


# ---------------------------------------------------------------- BatchNormalization

def lower_batch_norm(nodes: list[onnx.NodeProto], ranks: Mapping[str, int], opset: int,
                     running: Mapping[str, np.dtype], unique: Callable[[str], str]
                     ) -> tuple[list[onnx.NodeProto], list[tuple[str, str]]]:
    """Every BatchNormalization of ``nodes`` on batch statistics. ``ranks``: the rank of
    each BN input; ``running``: the initializers (name -> numpy dtype) whose running update
    is emitted.
    Returns (nodes, [(running-statistic initializer, its new value)])."""
    updates: list[tuple[str, str]] = []

    def lower(node, _):
        if opset < TRAIN_OPSET:
            raise TrainingOpError(
                f"BatchNormalization node {_label(node)!r}: mode='train' needs ai.onnx opset >= "
                f"{TRAIN_OPSET} (CastLike), found {opset} (see fit_opset)")
        rank = ranks.get(node.input[0])
        if rank is None or rank < 2:
            raise TrainingOpError(
                f"BatchNormalization node {_label(node)!r}: mode='train' needs the rank (>= 2) "
                f"of its input {node.input[0]!r}, found {rank}")
        em = _Emit(unique, opset, _label(node))
        updates.extend(_batch_norm(em, node, rank, running))
        return em.nodes

    return _replace(nodes, "BatchNormalization", lower), updates


def _batch_norm(em: _Emit, node: onnx.NodeProto, rank: int, running: Mapping[str, np.dtype]):
    x, scale, bias, mean, var = node.input[:5]
    axes = [0] + list(range(2, rank))
    # the batch statistics (two passes, mean and biased variance, as torch), flattened to [C]
    batch_mean = em.reduce_mean(x, axes)
    centered = em.op("Sub", [x, batch_mean])
    batch_var = em.reduce_mean(em.op("Mul", [centered, centered]), axes)
    flat = em.const(np.array([-1], np.int64))
    mean_in, var_in = em.op("Reshape", [batch_mean, flat]), em.op("Reshape", [batch_var, flat])
    # y: onnxruntime's (inference-mode) BatchNormalization, one pass, on these statistics;
    # marked as the builder's, its derivative rule is the closed form with the statistics'
    # dependence on x included (autodiff.rules_norm.batch_norm_batch_statistics)
    em.nodes.append(helper.make_node(
        "BatchNormalization", [x, scale, bias, mean_in, var_in], [node.output[0]],
        name=em.unique(f"{PREFIX}{em.hint}/output"), epsilon=float(_attr(node, "epsilon", 1e-5)),
        doc_string=BATCH_STATISTICS_DOC))
    if mean not in running or var not in running:  # no torch running-statistic update wanted
        return []
    # torch: running = (1 - m) running + m batch, m = 1 - momentum(ONNX); running_var takes
    # the unbiased variance n / (n - 1) * biased, n = elements per channel
    m = 1.0 - float(_attr(node, "momentum", 0.9))
    channels = em.op("Gather", [em.op("Shape", [x]), em.const(np.int64(1))], axis=0)
    n = em.op("CastLike", [em.op("Div", [em.op("Size", [x]), channels]), x])
    dtype = running.get(scale)  # constants of the parameters' type, no CastLike each step
    bessel = em.op("Div", [n, em.op("Sub", [n, em.like(1.0, x, dtype)])])
    updates = []
    for stat, batch in ((mean, mean_in), (var, em.op("Mul", [var_in, bessel]))):
        new = em.op("Add", [em.op("Mul", [stat, em.like(1.0 - m, x, dtype)]),
                            em.op("Mul", [batch, em.like(m, x, dtype)])])
        updates.append((stat, new))
    return updates


# ---------------------------------------------------------------- Dropout

def splitmix64(em: _Emit, counter: str, key: str) -> str:
    """SplitMix64's output for the uint64 ``counter`` of the stream ``key``:
    ``mix(key + counter * GAMMA)`` in wrapping uint64 arithmetic (onnxruntime's CPU kernels
    take uint64 for Mul, Add, BitShift and, from opset 18, BitwiseXor)."""
    z = em.op("Add", [em.op("Mul", [counter, em.const(np.uint64(GAMMA))]), key])
    for shift, multiplier in MIX:
        z = em.op("BitwiseXor", [z, em.op("BitShift", [z, em.const(np.uint64(shift))],
                                          direction="RIGHT")])
        if multiplier is not None:
            z = em.op("Mul", [z, em.const(np.uint64(multiplier))])
    return z


def stream_key(seed: int, ordinal: int) -> int:
    """The SplitMix64 stream of the ``ordinal``-th Dropout node for ``seed``: two mixes of
    (seed, ordinal) in Python, so neighbouring seeds and nodes get unrelated streams."""
    def mix(z: int) -> int:
        for shift, multiplier in MIX:
            z ^= z >> shift
            if multiplier is not None:
                z = z * multiplier % UINT64
        return z
    return mix((mix((seed + GAMMA) % UINT64) + (ordinal + 1) * GAMMA) % UINT64)


def dropout_keep(em: _Emit, x: str, step: str, key: int, ratio: float) -> str:
    """A bool tensor shaped like ``x``: True with probability 1 - ratio, independently per
    element, a function of (key, step, element index) only."""
    index = em.op("Range", [em.const(np.int64(0)), em.op("Size", [x]), em.const(np.int64(1))])
    index = em.op("Cast", [em.op("Reshape", [index, em.op("Shape", [x])])], to=TensorProto.UINT64)
    # per step: the stream's key advanced by T * 2**32 counters (a scalar)
    step_u64 = em.op("Cast", [step], to=TensorProto.UINT64)
    base = em.op("Add", [em.op("Mul", [step_u64, em.const(np.uint64(STEP_STRIDE * GAMMA % UINT64))]),
                         em.const(np.uint64(key))])
    threshold = min(int(round(ratio * UINT64)), UINT64 - 1)
    return em.op("GreaterOrEqual", [splitmix64(em, index, base), em.const(np.uint64(threshold))])


def lower_dropout(nodes: list[onnx.NodeProto], step: str, seed: int, opset: int,
                  constants: Mapping[str, np.ndarray], unique: Callable[[str], str]
                  ) -> list[onnx.NodeProto]:
    """Every Dropout of ``nodes`` in training mode: ``x * mask / (1 - ratio)`` (torch's
    scaling) with the mask of :func:`dropout_keep` for the int64 update count ``step``; the
    k-th Dropout draws from stream ``stream_key(seed, k)``. ``constants``: known values
    (the ratio must be one)."""

    def lower(node, ordinal):
        if opset < DROPOUT_OPSET:
            raise TrainingOpError(
                f"Dropout node {_label(node)!r}: mode='train' draws its masks with BitwiseXor, "
                f"which needs ai.onnx opset >= {DROPOUT_OPSET}, found {opset} (see fit_opset)")
        em = _Emit(unique, opset, _label(node))
        ratio = _dropout_ratio(node, constants)
        x = node.input[0]
        keep = dropout_keep(em, x, step, stream_key(seed, ordinal), ratio)
        kept = em.op("Where", [keep, x, em.like(0.0, x)])
        em.output("Mul", [kept, em.like(1.0 / (1.0 - ratio), x)], node.output[0])
        if len(node.output) > 1 and node.output[1]:
            em.output("Identity", [keep], node.output[1])
        return em.nodes

    return _replace(nodes, "Dropout", lower)


def _dropout_ratio(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> float:
    name = node.input[1] if len(node.input) > 1 and node.input[1] else None
    if name is None:
        ratio = float(_attr(node, "ratio", 0.5))  # opset < 12: an attribute
    elif name in constants:
        ratio = float(np.asarray(constants[name]).reshape(-1)[0])
    else:
        raise TrainingOpError(f"Dropout node {_label(node)!r}: mode='train' needs its ratio "
                              f"{name!r} to be a constant (an initializer or Constant node)")
    if not 0.0 <= ratio < 1.0:
        raise TrainingOpError(f"Dropout node {_label(node)!r}: ratio must be in [0, 1), found "
                              f"{ratio}")
    return ratio


def _constants(graph: onnx.GraphProto, nodes) -> dict[str, np.ndarray]:
    values = constant_values(graph.initializer)
    for n in nodes:
        if _is(n, "Constant") and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return values


# ---------------------------------------------------------------- the two graphs

def training_forward(graph: onnx.GraphProto, ranks: Mapping[str, int], opset: int, step: str,
                     seed: int, unique: Callable[[str], str]):
    """The training-mode copy of ``graph``'s forward pass (call :func:`to_inference` on
    ``graph`` first). ``ranks``: known ranks of values; ``step``: the int64 update count T.

    Returns (nodes, {eval value name: train value name}, [(running stat, new value)]).
    """
    nodes, renamed = copy_forward(graph, unique)
    copy_ranks = {renamed.get(name, name): r for name, r in ranks.items()}
    running = {t.name: helper.tensor_dtype_to_np_dtype(t.data_type) for t in graph.initializer}
    nodes, updates = lower_batch_norm(nodes, copy_ranks, opset, running, unique)
    nodes = lower_dropout(nodes, step, seed, opset, _constants(graph, nodes), unique)
    return nodes, renamed, updates


def fit_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` at the ai.onnx opset the lowered nodes need, converted by
    ``onnx.version_converter`` if it is older (its main graph in eval mode first,
    :func:`eval_mode_nodes`): 15 (CastLike), 18 with Dropout (BitwiseXor for the masks).
    Otherwise ``model`` itself."""
    opset = next((o.version for o in model.opset_import if o.domain in STANDARD_DOMAINS), 0)
    needed = DROPOUT_OPSET if any(_is(n, "Dropout") for n in model.graph.node) else TRAIN_OPSET
    if opset >= needed:
        return model
    eval_mode_nodes(model.graph)  # the converter refuses BatchNormalization's 5 outputs
    try:
        return onnx.version_converter.convert_version(model, needed)
    except Exception as error:  # noqa: BLE001
        raise TrainingOpError(
            f"mode='train' needs ai.onnx opset >= {needed} (CastLike, and BitwiseXor for "
            f"Dropout masks); the model imports opset {opset} and onnx.version_converter "
            f"failed: {error}. Export with opset_version={needed} or later") from error
