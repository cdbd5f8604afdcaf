"""Mixed precision: the matrix products of a graph in 16-bit, everything else in float32.

The builder runs :func:`mixed_precision` on the inference graph before the loss, the Gradient
and the optimizer are added (``build_training_model(..., precision="fp16" | "bf16")``). For
each node of torch autocast's lower-precision list that has a 16-bit kernel on the target
execution provider (:data:`KERNELS_16BIT`), its float32 inputs are cast to 16-bit and its
outputs cast back to float32; a value cast back and cast down again between two 16-bit nodes
is read as the 16-bit value directly (the pair is exact, so nothing changes but two Casts).
Every other op (softmax, layer/batch norm, elementwise ops, reductions, the loss) keeps
running in float32, like torch autocast's float32 list and its "promote" ops fed float32.

The weights stay float32 initializers (the master weights), so the optimizer state is float32
too; the Gradient flows back through the Casts (Cast's derivative casts the gradient back to
its input's type), so the backward of each 16-bit node runs in 16-bit and the weight
gradients arrive in float32.

Only the top-level graph is rewritten (nodes inside If/Loop bodies stay float32).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from ..errors import TrainingOpError
from ._graph import all_names, unique_name, value_types

PRECISIONS = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
"""``precision=`` -> the 16-bit element type."""

LOWER_PRECISION_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")
"""torch autocast's lower-precision ops that ONNX graphs hold (torch exports attention as
MatMul + Softmax + MatMul: its matrix products are covered by MatMul)."""

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"

KERNELS_16BIT: dict[str, dict[str, frozenset[str]]] = {
    # onnxruntime 1.32's CPU EP (x86-64) has no 16-bit compute kernel for any of these ops:
    # a float16 MatMul, Gemm, Conv, ConvTranspose or Einsum (and Add, Mul, Softmax, ReduceSum,
    # Relu...) runs in float32 between casts that onnxruntime inserts ("InsertedPrecisionFreeCast"
    # in the optimized model; only Transpose, Reshape and Cast move 16-bit data), and the casts
    # around it are dropped; bfloat16 ones fail with NOT_IMPLEMENTED. So no node goes 16-bit
    # for the CPU.
    CPU: {"fp16": frozenset(), "bf16": frozenset()},
    # onnxruntime's CUDA EP registrations (core/providers/cuda/cuda_execution_provider.cc):
    # MLFloat16 for all five; BFloat16 for MatMul and Gemm (and Add/Sub/Mul/Div, ReduceSum,
    # Cast, Softmax that their gradients use), none for Conv, ConvTranspose, Einsum.
    CUDA: {"fp16": frozenset(LOWER_PRECISION_OPS), "bf16": frozenset({"MatMul", "Gemm"})},
}
"""Execution provider -> precision -> the ops of :data:`LOWER_PRECISION_OPS` it runs in 16-bit.
An op missing here for the target provider stays float32 (never a CPU fallback on a GPU)."""


@dataclass(frozen=True)
class MixedPrecision:
    """What :func:`mixed_precision` did: the 16-bit nodes and the ones kept float32."""

    precision: str
    provider: str
    converted: tuple[str, ...]  # node names (or op_type#index) now running in 16-bit
    kept_fp32: tuple[str, ...]  # lower-precision ops left float32: no kernel on the provider, or not float32 inputs


def default_provider(precision: str) -> str:
    """The provider whose kernels decide the 16-bit nodes when none is named: the CUDA EP
    (mixed precision is a GPU feature; onnxruntime's CPU EP runs an fp16 graph too, in float32)."""
    return CUDA


def ops_for(precision: str, provider: str | None = None) -> frozenset[str]:
    """The ops that go 16-bit for ``precision`` on ``provider``.

    Raises:
        TrainingOpError: an unknown precision or provider.
    """
    if precision not in PRECISIONS:
        raise TrainingOpError(f"precision must be 'fp32', 'fp16' or 'bf16', found {precision!r}")
    provider = provider or default_provider(precision)
    if provider not in KERNELS_16BIT:
        raise TrainingOpError(f"precision_provider {provider!r} has no 16-bit kernel list; known: "
                              f"{', '.join(KERNELS_16BIT)}")
    return KERNELS_16BIT[provider][precision]


def _label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


def mixed_precision(model: onnx.ModelProto, precision: str,
                    provider: str | None = None) -> tuple[onnx.ModelProto, MixedPrecision]:
    """``model`` with its lower-precision ops in 16-bit (in place; also returned) and a report.

    Args:
        model: an inference model (float32 weights).
        precision: ``"fp16"`` or ``"bf16"``.
        provider: the execution provider whose 16-bit kernels decide which ops convert
            (:data:`KERNELS_16BIT`); default :func:`default_provider`.

    Returns:
        The model and a :class:`MixedPrecision` report.

    Raises:
        TrainingOpError: an unknown precision or provider.
    """
    ops = ops_for(precision, provider)
    provider = provider or default_provider(precision)
    low = PRECISIONS[precision]
    graph = model.graph
    types = value_types(model)
    taken = all_names(graph)
    tag = precision
    down: dict[str, str] = {}  # float32 value -> its 16-bit form (a Cast we added, or a 16-bit output)
    ups: set[str] = set()  # float32 values made by our Casts back up
    nodes: list[onnx.NodeProto] = []
    converted, kept = [], []
    for index, node in enumerate(graph.node):
        if node.op_type not in LOWER_PRECISION_OPS or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        floats = [name for name in node.input if name]
        elem = [types[name].elem_type if name in types else None for name in floats]
        if node.op_type not in ops or any(e != TensorProto.FLOAT for e in elem):
            kept.append(_label(node, index))
            nodes.append(node)
            continue
        for k, name in enumerate(node.input):
            if not name:
                continue
            if name not in down:  # (a 16-bit node's output is there already: its Cast pair is skipped)
                cast = unique_name(taken, f"{name}.{tag}")
                nodes.append(helper.make_node("Cast", [name], [cast], to=low, name=unique_name(taken, f"{cast}/cast")))
                down[name] = cast
            node.input[k] = down[name]
        nodes.append(node)
        for k, name in enumerate(node.output):
            if not name:
                continue
            low_name = unique_name(taken, f"{name}.{tag}")
            node.output[k] = low_name
            nodes.append(helper.make_node("Cast", [low_name], [name], to=TensorProto.FLOAT,
                                          name=unique_name(taken, f"{name}/cast_up")))
            ups.add(name)
            down[name] = low_name
        converted.append(_label(node, index))
    del graph.node[:]
    graph.node.extend(_without_dead_casts(nodes, ups, graph.output))
    return model, MixedPrecision(precision, provider, tuple(converted), tuple(kept))


def _without_dead_casts(nodes: list[onnx.NodeProto], ups: set[str],
                        outputs: Iterable[onnx.ValueInfoProto]) -> list[onnx.NodeProto]:
    """Drop our Casts back to float32 that nothing reads any more (their consumers read the
    16-bit value directly now)."""
    read = {name for n in nodes for name in n.input} | {o.name for o in outputs}
    for n in nodes:
        for attr in n.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                read |= all_names(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    read |= all_names(g)
    return [n for n in nodes
            if not (n.op_type == "Cast" and len(n.output) == 1 and n.output[0] in ups and n.output[0] not in read)]

